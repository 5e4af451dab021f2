//! A TCP proxy in front of a real server that loses answers: it forwards each HTTP/1.1 request,
//! waits for the server's whole answer (so the server has acted), then either relays it or, for
//! the requests the test picks, closes the connection without a word. It can also hold every
//! answer back for a while, to make two clients overlap. One request per connection: it asks
//! the server to close after answering and tells the client the same.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Which answers to lose: `(path, n)` is the n-th request (from 1) for that path.
pub(crate) type LoseRule = dyn Fn(&str, usize) -> bool + Send + Sync;

pub(crate) struct LossyProxy {
    pub(crate) port: u16,
    lost: Arc<AtomicUsize>,
}

impl LossyProxy {
    /// Listens on a free port of 127.0.0.1 and forwards to `upstream` there, until the test
    /// binary ends.
    pub(crate) fn start(upstream: u16, delay: Duration, lose: Box<LoseRule>) -> LossyProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let lost = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
        let lose: Arc<LoseRule> = Arc::from(lose);
        let counter = lost.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (seen, lose, counter) = (seen.clone(), lose.clone(), counter.clone());
                std::thread::spawn(move || {
                    let _ = relay(client, upstream, delay, &seen, &*lose, &counter);
                });
            }
        });
        LossyProxy { port, lost }
    }

    /// How many answers were lost so far.
    pub(crate) fn lost(&self) -> usize {
        self.lost.load(Ordering::SeqCst)
    }
}

/// Reads an HTTP head (up to the blank line) and returns its lines.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Vec<String>> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let line = line.trim_end_matches(['\r', '\n']).to_owned();
        if line.is_empty() {
            return Ok(lines);
        }
        lines.push(line);
    }
}

/// The head with `Connection: close` instead of whatever it said about the connection.
fn closing(head: &[String]) -> Vec<u8> {
    let mut out = String::new();
    for line in head
        .iter()
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
    {
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

fn relay(
    client: TcpStream,
    upstream: u16,
    delay: Duration,
    seen: &Mutex<HashMap<String, usize>>,
    lose: &LoseRule,
    lost: &AtomicUsize,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let head = read_head(&mut reader)?;
    let path = head
        .first()
        .and_then(|l| l.split(' ').nth(1))
        .unwrap_or("")
        .split('?')
        .next()
        .unwrap_or("")
        .to_owned();
    let length: usize = head
        .iter()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    let n = {
        let mut seen = seen.lock().unwrap();
        let n = seen.entry(path.clone()).or_insert(0);
        *n += 1;
        *n
    };
    let mut server = TcpStream::connect(("127.0.0.1", upstream))?;
    server.write_all(&closing(&head))?;
    server.write_all(&body)?;
    let mut answer = Vec::new();
    server.read_to_end(&mut answer)?;
    std::thread::sleep(delay);
    let mut client = client;
    if lose(&path, n) {
        lost.fetch_add(1, Ordering::SeqCst);
        return client.shutdown(Shutdown::Both);
    }
    // Relay the answer, telling the client that the connection closes after it.
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(answer.len());
    let head: Vec<String> = String::from_utf8_lossy(&answer[..split])
        .split("\r\n")
        .map(str::to_owned)
        .collect();
    client.write_all(&closing(&head))?;
    client.write_all(answer.get(split + 4..).unwrap_or(&[]))?;
    client.flush()?;
    client.shutdown(Shutdown::Both)
}
