//! Headless Chromium driven over the Chrome DevTools Protocol (a websocket, tungstenite): start
//! it, open a page, evaluate JavaScript, click and type as a user would (real input events),
//! wait for conditions, take screenshots.

#![allow(missing_docs)]

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use tungstenite::{Message, WebSocket, stream::MaybeTlsStream};

use crate::common::Tied;

/// Where Chromium is, or why the browser tests cannot run here.
pub(crate) fn find_chromium() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("HARNESS_CHROMIUM") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "HARNESS_CHROMIUM names {}, which is no file",
                p.display()
            ))
        };
    }
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
            let p = dir.join(name);
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    Err(
        "no chromium, chromium-browser or google-chrome on PATH (HARNESS_CHROMIUM names one)"
            .into(),
    )
}

/// A headless Chromium with one page open; killed when dropped.
pub(crate) struct Browser {
    ws: WebSocket<MaybeTlsStream<TcpStream>>,
    next: u64,
    _process: Tied,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium (a fresh profile, a 1400x1000 window) and attaches to its page.
    pub(crate) fn start(chromium: &Path) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut process = Tied::spawn(
            Tied::command(chromium)
                .args([
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--hide-scrollbars",
                    "--remote-debugging-port=0",
                    "--window-size=1400,1000",
                    "--force-device-scale-factor=1",
                ])
                .arg(format!("--user-data-dir={}", profile.path().display()))
                .arg("about:blank")
                .stdout(Stdio::null())
                .stderr(Stdio::piped()),
        );
        // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
        let stderr = process.child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(url) = line.split("DevTools listening on ").nth(1) {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let browser_url = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("chromium did not print its DevTools address within 60 s");
        let port = browser_url
            .trim_start_matches("ws://")
            .split(['/', ':'])
            .nth(1)
            .unwrap()
            .to_string();
        let page_url = {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let list: Value =
                    reqwest::blocking::get(format!("http://127.0.0.1:{port}/json/list"))
                        .and_then(|r| r.json())
                        .unwrap_or(Value::Null);
                let page = list.as_array().and_then(|l| {
                    l.iter()
                        .find(|t| t["type"] == "page")
                        .and_then(|t| t["webSocketDebuggerUrl"].as_str().map(String::from))
                });
                if let Some(p) = page {
                    break p;
                }
                assert!(Instant::now() < deadline, "chromium opened no page: {list}");
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        let (ws, _) = tungstenite::connect(&page_url).expect("connecting to the page's DevTools");
        if let MaybeTlsStream::Plain(s) = ws.get_ref() {
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        }
        let mut b = Browser {
            ws,
            next: 1,
            _process: process,
            _profile: profile,
        };
        b.call("Page.enable", json!({}));
        b.call("Runtime.enable", json!({}));
        b
    }

    /// Sends one command and waits for its answer (events in between are dropped); panics
    /// with the protocol's error.
    pub(crate) fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next;
        self.next += 1;
        let msg = json!({ "id": id, "method": method, "params": params });
        self.ws.send(Message::text(msg.to_string())).unwrap();
        loop {
            let m = self.ws.read().unwrap_or_else(|e| panic!("{method}: {e}"));
            let Message::Text(t) = m else { continue };
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["id"] == id {
                if let Some(e) = v.get("error") {
                    panic!("{method} failed: {e}");
                }
                return v["result"].clone();
            }
        }
    }

    /// Evaluates `expr` in the page (promises awaited); its value as JSON. A thrown exception
    /// panics with its text.
    pub(crate) fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({ "expression": expr, "awaitPromise": true, "returnByValue": true }),
        );
        if let Some(ex) = r.get("exceptionDetails") {
            panic!("`{expr}` threw: {ex}");
        }
        r["result"]["value"].clone()
    }

    /// The text of every element `selector` matches, in page order.
    pub(crate) fn texts(&mut self, selector: &str) -> Vec<String> {
        let sel = serde_json::to_string(selector).unwrap();
        let v = self.eval(&format!(
            "[...document.querySelectorAll({sel})].map(e => e.textContent)"
        ));
        serde_json::from_value(v).unwrap()
    }

    /// Polls `expr` until it is `true`; panics naming `what` (and the page's text) after `limit`.
    pub(crate) fn wait(&mut self, what: &str, expr: &str, limit: Duration) {
        let start = Instant::now();
        while self.eval(&format!("!!({expr})")) != json!(true) {
            if start.elapsed() > limit {
                let text = self.eval("document.body.innerText");
                panic!(
                    "timed out after {limit:?} waiting for {what} (`{expr}`); the page says:\n{text}"
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Opens `url` afresh and waits until the page has drawn its view.
    pub(crate) fn open(&mut self, url: &str) {
        // through a blank page, so that it is a fresh load even when only the hash differs (or
        // nothing does)
        self.call("Page.navigate", json!({ "url": "about:blank" }));
        self.wait(
            "a blank page",
            "location.href === 'about:blank'",
            Duration::from_secs(10),
        );
        self.call("Page.navigate", json!({ "url": url }));
        self.wait(
            "the page to load",
            "window.harnessUi && window.harnessUi.ready",
            Duration::from_secs(30),
        );
    }

    /// Clicks the centre of the element `selector` names with the mouse (press and release).
    pub(crate) fn click(&mut self, selector: &str) {
        let sel = serde_json::to_string(selector).unwrap();
        let at = self.eval(&format!(
            "(() => {{ const e = document.querySelector({sel}); if (!e) return null; \
             e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect(); \
             return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
        ));
        let (x, y) = match at.as_array() {
            Some(a) => (a[0].as_f64().unwrap(), a[1].as_f64().unwrap()),
            None => panic!("nothing on the page matches {selector}"),
        };
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({ "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1 }),
            );
        }
    }

    /// Focuses `selector`, selects what it holds, and types `text` over it, then Enter.
    pub(crate) fn type_into(&mut self, selector: &str, text: &str) {
        self.click(selector);
        let sel = serde_json::to_string(selector).unwrap();
        self.eval(&format!("document.querySelector({sel}).select()"));
        self.call("Input.insertText", json!({ "text": text }));
        for kind in ["keyDown", "keyUp"] {
            self.call(
                "Input.dispatchKeyEvent",
                json!({ "type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13 }),
            );
        }
    }

    /// A PNG of the whole page, written to `file`.
    pub(crate) fn screenshot(&mut self, file: &Path) {
        let r = self.call(
            "Page.captureScreenshot",
            json!({ "format": "png", "captureBeyondViewport": true }),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().unwrap())
            .unwrap();
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, png).unwrap();
    }
}
