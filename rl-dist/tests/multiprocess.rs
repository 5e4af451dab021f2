//! Real c10d groups on 127.0.0.1: the test binary re-executes itself as 2 or 3 ranks (the role is
//! chosen by `RL_DIST_TEST_ROLE`), each joining with `ProcessGroup::from_env` like under torchrun.

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use rl_dist::{Error, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

const ROLE: &str = "RL_DIST_TEST_ROLE";
/// Generous bound for rendezvous and collectives in the happy paths: the machine is shared.
const SLOW_OK: Duration = Duration::from_secs(90);
/// Bound on a whole spawned group; past it every child is killed and the test fails.
const GROUP_DEADLINE: Duration = Duration::from_secs(240);
/// The timeout the failure scenario configures.
const SHORT_TIMEOUT: Duration = Duration::from_secs(4);

/// Kills (and reaps) every child still running when dropped, so a failing test leaves no ranks.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for child in &mut self.0 {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr").port()
}

/// Runs `role` as `world_size` ranks of this test binary and returns each rank's output.
fn spawn_group(role: &str, world_size: usize, env_without: Option<&str>) -> Vec<Output> {
    spawn_ranks(role, world_size, world_size, env_without)
}

/// Runs ranks `0..started` of a world of `world_size` (fewer than all models a missing rank).
fn spawn_ranks(
    role: &str,
    world_size: usize,
    started: usize,
    env_without: Option<&str>,
) -> Vec<Output> {
    // The port is free when picked but another process may take it before rank 0 binds it:
    // that (and only that) is retried with a fresh port.
    for _ in 0..3 {
        let outputs = spawn_once(role, world_size, started, env_without);
        let port_taken = outputs.iter().any(|o| {
            let err = String::from_utf8_lossy(&o.stderr);
            err.contains("EADDRINUSE") || err.to_lowercase().contains("address already in use")
        });
        if !port_taken {
            return outputs;
        }
    }
    panic!("{role}: no free port for the store after 3 tries");
}

fn spawn_once(
    role: &str,
    world_size: usize,
    started: usize,
    env_without: Option<&str>,
) -> Vec<Output> {
    let exe = std::env::current_exe().expect("test binary path");
    let port = free_port().to_string();
    let mut ranks = Ranks(Vec::new());
    for rank in 0..started {
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env_remove("GLOO_SOCKET_IFNAME")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(var) = env_without {
            cmd.env_remove(var);
        }
        ranks.0.push(cmd.spawn().expect("spawn a rank"));
    }
    let start = Instant::now();
    loop {
        let all_done = ranks
            .0
            .iter_mut()
            .all(|c| matches!(c.try_wait(), Ok(Some(_))));
        if all_done {
            break;
        }
        if start.elapsed() > GROUP_DEADLINE {
            // `ranks` kills the rest on drop; report what they printed so far is not possible
            // once killed, so name the scenario.
            panic!("{role} with {world_size} ranks did not finish in {GROUP_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let children = std::mem::take(&mut ranks.0);
    children
        .into_iter()
        .map(|c| c.wait_with_output().expect("rank output"))
        .collect()
}

fn assert_all_ok(role: &str, outputs: &[Output]) {
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "{role}: rank {rank} failed ({})\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&format!("{role} ok")),
            "{role}: rank {rank} did not report success:\n{}",
            String::from_utf8_lossy(&out.stdout),
        );
    }
}

/// The child side: does nothing unless this process was spawned as a rank.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        "collectives" => collectives(),
        "early_exit" => early_exit(),
        "stalled_peer" => stalled_peer(),
        "missing_port" => missing_port(),
        "lonely" => lonely(),
        "core_helpers" => core_helpers(),
        other => panic!("unknown role {other}"),
    }
    println!("{role} ok");
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).expect("to vec")
}

/// A collective that only forwards the trait's required methods, so the trait's default
/// `reduce_scatter` and `all_gather_flat` run over a real group.
struct AllReduceOnly<'a>(&'a mut ProcessGroup);

impl rl_core::dist::Collective for AllReduceOnly<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(&mut self, t: &mut [Tensor], op: rl_core::dist::ReduceOp) -> rl_core::Result<()> {
        rl_core::dist::Collective::all_reduce(self.0, t, op)
    }
    fn all_gather(&mut self, t: &Tensor) -> rl_core::Result<Vec<Tensor>> {
        rl_core::dist::Collective::all_gather(self.0, t)
    }
    fn broadcast(&mut self, t: &mut Tensor, src: usize) -> rl_core::Result<()> {
        rl_core::dist::Collective::broadcast(self.0, t, src)
    }
    fn barrier(&mut self) -> rl_core::Result<()> {
        rl_core::dist::Collective::barrier(self.0)
    }
}

fn collectives() {
    let mut pg = ProcessGroup::from_env(SLOW_OK).expect("join the group");
    let (rank, world) = (pg.rank(), pg.world_size());
    assert_eq!(
        world,
        std::env::var("WORLD_SIZE")
            .unwrap()
            .parse::<usize>()
            .unwrap()
    );
    let r = rank as f64;
    let w = world as f64;
    let ranks_sum: f64 = (0..world).map(|i| i as f64).sum();

    // Rank-dependent values: rank r holds [r + 1, 2(r + 1), -r].
    let mine = |kind: Kind| Tensor::from_slice(&[r + 1.0, 2.0 * (r + 1.0), -r]).to_kind(kind);
    let sum = [ranks_sum + w, 2.0 * (ranks_sum + w), -ranks_sum];
    for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
        let mut t = mine(kind);
        pg.all_reduce(&mut t, ReduceOp::Sum).expect("sum");
        assert_eq!(t.kind(), kind);
        assert_eq!(to_f64(&t), sum, "sum {kind:?}");

        let mut t = mine(kind);
        pg.all_reduce(&mut t, ReduceOp::Max).expect("max");
        assert_eq!(to_f64(&t), [w, 2.0 * w, 0.0], "max {kind:?}");

        let mut t = mine(kind);
        pg.all_reduce(&mut t, ReduceOp::Min).expect("min");
        assert_eq!(to_f64(&t), [1.0, 2.0, -(w - 1.0)], "min {kind:?}");
    }
    for kind in [Kind::Float, Kind::BFloat16] {
        let mut t = mine(kind);
        pg.all_reduce(&mut t, ReduceOp::Avg).expect("avg");
        let want: Vec<f64> = sum.iter().map(|s| s / w).collect();
        let got = to_f64(&t);
        for (g, e) in got.iter().zip(&want) {
            assert!(
                (g - e).abs() <= 1e-2 * e.abs().max(1.0),
                "avg {kind:?}: {got:?} vs {want:?}"
            );
        }
    }
    let mut ints = mine(Kind::Int64);
    assert!(matches!(
        pg.all_reduce(&mut ints, ReduceOp::Avg),
        Err(Error::InvalidArgument {
            op: "all_reduce",
            ..
        })
    ));

    // all_gather: rank r contributes a [2, 3] tensor filled with r.
    let gathered = pg
        .all_gather(&Tensor::full([2, 3], r, (Kind::Float, Device::Cpu)))
        .expect("all_gather");
    assert_eq!(gathered.len(), world);
    for (i, g) in gathered.iter().enumerate() {
        assert_eq!(g.size(), [2, 3]);
        assert_eq!(to_f64(g), vec![i as f64; 6], "gathered slot {i}");
    }

    // broadcast from the last rank.
    let src = world - 1;
    let mut t = Tensor::from_slice(&[r * 10.0 + 1.0, r]).to_kind(Kind::Float);
    pg.broadcast(&mut t, src).expect("broadcast");
    assert_eq!(to_f64(&t), [src as f64 * 10.0 + 1.0, src as f64]);
    assert!(matches!(
        pg.broadcast(&mut t, world),
        Err(Error::InvalidArgument {
            op: "broadcast",
            ..
        })
    ));

    pg.barrier().expect("barrier");

    // reduce_scatter: rank r holds [0, 1, .., 2w - 1] * (r + 1); rank r gets elements
    // [2r, 2r + 2) of the sum, and the trait's default (all-reduce, keep a part) agrees.
    let flat = |kind: Kind| {
        (Tensor::arange(2 * world as i64, (Kind::Double, Device::Cpu)) * (r + 1.0)).to_kind(kind)
    };
    let tri = w * (w + 1.0) / 2.0;
    for kind in [Kind::Float, Kind::BFloat16, Kind::Int64] {
        let got = pg
            .reduce_scatter(&flat(kind), ReduceOp::Sum)
            .expect("reduce_scatter");
        assert_eq!(got.kind(), kind);
        assert_eq!(
            to_f64(&got),
            [2.0 * r * tri, (2.0 * r + 1.0) * tri],
            "{kind:?}"
        );
    }
    let avg = pg
        .reduce_scatter(&flat(Kind::Float), ReduceOp::Avg)
        .expect("reduce_scatter avg");
    assert_eq!(to_f64(&avg), [2.0 * r * tri / w, (2.0 * r + 1.0) * tri / w]);
    let default = rl_core::dist::Collective::reduce_scatter(
        &mut AllReduceOnly(&mut pg),
        &flat(Kind::Float),
        rl_core::dist::ReduceOp::Avg,
    )
    .expect("default reduce_scatter");
    assert_eq!(to_f64(&default), to_f64(&avg));
    assert!(matches!(
        pg.reduce_scatter(
            &Tensor::zeros([2 * world as i64 + 1], (Kind::Float, Device::Cpu)),
            ReduceOp::Sum
        ),
        Err(Error::InvalidArgument {
            op: "reduce_scatter",
            ..
        })
    ));

    // all_gather_flat: rank r contributes [r, r, r]; the result is every rank's, in order.
    let gathered = pg
        .all_gather_flat(&Tensor::full([3], r, (Kind::Float, Device::Cpu)))
        .expect("all_gather_flat");
    let want: Vec<f64> = (0..world).flat_map(|i| [i as f64; 3]).collect();
    assert_eq!(to_f64(&gathered), want);
    let default = rl_core::dist::Collective::all_gather_flat(
        &mut AllReduceOnly(&mut pg),
        &Tensor::full([3], r, (Kind::Float, Device::Cpu)),
    )
    .expect("default all_gather_flat");
    assert_eq!(to_f64(&default), want);

    // all_gather_flat started ahead (FSDP's prefetch): collectives issued while it is in
    // flight (a reduce-scatter and an all-reduce) complete in their turn, and its wait gives
    // what the blocking gather gives; through the trait, and the trait's default too.
    let input = Tensor::full([3], r, (Kind::BFloat16, Device::Cpu));
    let ahead = pg
        .all_gather_flat_start(&input)
        .expect("all_gather_flat_start");
    let meanwhile = pg
        .reduce_scatter(
            &Tensor::ones([2 * world as i64], (Kind::Float, Device::Cpu)),
            ReduceOp::Sum,
        )
        .expect("reduce_scatter while a gather is in flight");
    assert_eq!(to_f64(&meanwhile), vec![world as f64; 2]);
    let mut flag = Tensor::from_slice(&[r]);
    pg.all_reduce(&mut flag, ReduceOp::Max).expect("all_reduce");
    assert_eq!(to_f64(&ahead.wait().expect("wait")), want);
    let through_trait =
        rl_core::dist::Collective::all_gather_flat_start(&mut pg, &input).expect("trait start");
    assert_eq!(to_f64(&through_trait.wait().expect("trait wait")), want);
    let by_default =
        rl_core::dist::Collective::all_gather_flat_start(&mut AllReduceOnly(&mut pg), &input)
            .expect("default start");
    assert_eq!(to_f64(&by_default.wait().expect("default wait")), want);

    // Bucketed all-reduce equals per-tensor all-reduce, with mixed dtypes and a bucket so small
    // that the list spans several buckets.
    let grads = |seed: f64| -> Vec<Tensor> {
        let f = |n: i64, k: Kind| {
            (Tensor::arange(n, (Kind::Double, Device::Cpu)) * (seed + 1.0) - seed).to_kind(k)
        };
        vec![
            f(5, Kind::Float),
            f(12, Kind::Float).view([3, 4]),
            f(7, Kind::Int64),
            f(300, Kind::Float).view([10, 30]),
            f(3, Kind::BFloat16),
            f(1, Kind::Float),
            f(40, Kind::Float).view([2, 4, 5]),
        ]
    };
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut one_by_one = grads(r);
        for t in &mut one_by_one {
            pg.all_reduce(t, op).expect("per-tensor");
        }
        let mut bucketed = grads(r);
        pg.all_reduce_bucketed(&mut bucketed, op, 256)
            .expect("bucketed");
        for (a, b) in one_by_one.iter().zip(&bucketed) {
            assert_eq!(a.size(), b.size());
            assert_eq!(a.kind(), b.kind());
            assert_eq!(to_f64(a), to_f64(b), "{op:?}");
        }
        let mut default_buckets = grads(r);
        pg.all_reduce_many(&mut default_buckets, op)
            .expect("all_reduce_many");
        for (a, b) in one_by_one.iter().zip(&default_buckets) {
            assert_eq!(to_f64(a), to_f64(b), "{op:?} default buckets");
        }
    }
    pg.barrier().expect("final barrier");
}

fn early_exit() {
    let mut pg = ProcessGroup::from_env(SLOW_OK).expect("join the group");
    pg.barrier().expect("everyone is up");
    pg.set_timeout(SHORT_TIMEOUT).expect("shorter timeout");
    if pg.rank() == 1 {
        // Leave without a word: rank 0 must not hang on its next collective.
        std::process::exit(0);
    }
    std::thread::sleep(Duration::from_millis(500));
    expect_timely_failure(&mut pg, Duration::ZERO);
}

fn stalled_peer() {
    let mut pg = ProcessGroup::from_env(SLOW_OK).expect("join the group");
    pg.barrier().expect("everyone is up");
    pg.set_timeout(SHORT_TIMEOUT).expect("shorter timeout");
    if pg.rank() == 1 {
        // Alive but never joining the collective; leave only after rank 0 has given up.
        std::thread::sleep(SHORT_TIMEOUT * 4);
        std::process::exit(0);
    }
    // With the peer alive, only the timeout can end the wait.
    expect_timely_failure(&mut pg, SHORT_TIMEOUT.mul_f64(0.9));
}

/// The next collective fails with an error naming this rank and the op, between `at_least` and a
/// bound well under the group deadline.
fn expect_timely_failure(pg: &mut ProcessGroup, at_least: Duration) {
    let start = Instant::now();
    let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let err = pg
        .all_reduce(&mut t, ReduceOp::Sum)
        .expect_err("the peer is gone");
    let waited = start.elapsed();
    eprintln!("rank 0 gave up after {waited:?}: {err}");
    assert!(
        waited >= at_least,
        "gave up after {waited:?}, before {at_least:?}"
    );
    assert!(
        waited < SHORT_TIMEOUT * 2 + Duration::from_secs(20),
        "waited {waited:?}"
    );
    match &err {
        Error::Collective {
            rank: 0,
            op: "all_reduce",
            ..
        } => {}
        other => panic!("unexpected error {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains("rank 0") && message.contains("all_reduce"),
        "{message}"
    );
}

fn lonely() {
    let start = Instant::now();
    let err = ProcessGroup::from_env(SHORT_TIMEOUT).expect_err("rank 1 never comes");
    let waited = start.elapsed();
    eprintln!("rank 0 gave up joining after {waited:?}: {err}");
    assert!(
        matches!(
            err,
            Error::Collective {
                rank: 0,
                op: "init",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        waited < SHORT_TIMEOUT * 2 + Duration::from_secs(20),
        "waited {waited:?}"
    );
}

fn missing_port() {
    let err = ProcessGroup::from_env(SLOW_OK).expect_err("MASTER_PORT is missing");
    assert!(
        matches!(err, Error::MissingEnv { var: "MASTER_PORT" }),
        "{err:?}"
    );
    assert!(err.to_string().contains("MASTER_PORT"), "{err}");
}

/// rl-core's data-parallel helpers over a real group, through the `Collective` impl: counts,
/// uneven byte strings, ragged rows, metric reduction and the replica check.
fn core_helpers() {
    use std::collections::BTreeMap;

    use rl_core::dist::{self, Collective, MetricReduce};

    let pg = ProcessGroup::from_env(SLOW_OK).expect("join");
    let (rank, world) = (pg.rank(), pg.world_size());
    let group = dist::share(pg);
    let mut g = dist::lock(&group).unwrap();
    let c: &mut dyn Collective = &mut *g;
    assert_eq!((c.rank(), c.world_size()), (rank, world));

    let mut counts = [rank as f64 + 1.0, 10.0];
    dist::all_reduce_f64(c, &mut counts, dist::ReduceOp::Sum).unwrap();
    let w = world as f64;
    assert_eq!(counts, [w * (w + 1.0) / 2.0, 10.0 * w]);

    // rank r sends r + 1 bytes
    let mine: Vec<u8> = (0..=rank as u8).collect();
    let all = dist::all_gather_bytes(c, &mine).unwrap();
    for (r, b) in all.iter().enumerate() {
        assert_eq!(b, &(0..=r as u8).collect::<Vec<u8>>());
    }

    // rank r holds r + 1 rows of width 2 + r, filled with r
    let rows = rank as i64 + 1;
    let t = Tensor::full(
        [rows, 2 + rank as i64],
        rank as f64,
        (Kind::Float, Device::Cpu),
    );
    let got = dist::gather_rows(c, &t).unwrap();
    let total: i64 = (1..=world as i64).sum();
    assert_eq!(got.size(), vec![total, 1 + world as i64]);
    let mut row = 0;
    for r in 0..world as i64 {
        for _ in 0..=r {
            let line = to_f64(&got.get(row));
            let width = (2 + r) as usize;
            assert!(line[..width].iter().all(|&v| v == r as f64), "{line:?}");
            assert!(line[width..].iter().all(|&v| v == 0.0), "{line:?}");
            row += 1;
        }
    }

    let mut m = BTreeMap::new();
    m.insert("a/mean".to_owned(), (rank as f64, rank as f64 + 1.0));
    m.insert("a/max".to_owned(), (rank as f64, 1.0));
    m.insert("perf/total_num_tokens".to_owned(), (2.0, 1.0));
    if rank == 0 {
        m.insert("only/rank0".to_owned(), (7.0, 1.0));
    }
    let red = dist::reduce_metrics(c, &m, dist::default_reduce).unwrap();
    let weights: f64 = (1..=world).map(|r| r as f64).sum();
    let mean: f64 = (0..world).map(|r| r as f64 * (r as f64 + 1.0)).sum::<f64>() / weights;
    assert!((red["a/mean"] - mean).abs() < 1e-12);
    assert_eq!(red["a/max"], w - 1.0);
    assert_eq!(red["perf/total_num_tokens"], 2.0 * w);
    assert_eq!(red["only/rank0"], 7.0);
    assert_eq!(dist::default_reduce("a/max"), MetricReduce::Max);

    let same = Tensor::from_slice(&[1.0f32, 2.0]);
    dist::check_replicas(c, "weights", &[same.shallow_clone()]).unwrap();
    let differs = if rank == world - 1 {
        Tensor::from_slice(&[1.0f32, 2.5])
    } else {
        same
    };
    let err = dist::check_replicas(c, "weights", &[differs]).unwrap_err();
    assert!(
        err.to_string().contains(&format!("[{}]", world - 1)),
        "{err}"
    );
}

#[test]
fn core_helpers_work_over_three_ranks() {
    let outputs = spawn_group("core_helpers", 3, None);
    assert_all_ok("core_helpers", &outputs);
}

#[test]
fn two_ranks_agree_on_every_collective() {
    let outputs = spawn_group("collectives", 2, None);
    assert_all_ok("collectives", &outputs);
}

#[test]
fn three_ranks_agree_on_every_collective() {
    let outputs = spawn_group("collectives", 3, None);
    assert_all_ok("collectives", &outputs);
}

#[test]
fn missing_master_port_is_an_error_naming_it() {
    let outputs = spawn_group("missing_port", 1, Some("MASTER_PORT"));
    assert_all_ok("missing_port", &outputs);
}

#[test]
fn a_rank_that_exits_early_fails_the_next_collective_instead_of_hanging() {
    let outputs = spawn_group("early_exit", 2, None);
    // Rank 1 exits before printing; only rank 0's outcome is checked.
    assert_all_ok("early_exit", &outputs[..1]);
}

#[test]
fn a_stalled_rank_fails_the_next_collective_after_the_timeout() {
    let outputs = spawn_group("stalled_peer", 2, None);
    assert_all_ok("stalled_peer", &outputs[..1]);
}

#[test]
fn rendezvous_without_the_other_ranks_times_out() {
    let outputs = spawn_ranks("lonely", 2, 1, None);
    assert_all_ok("lonely", &outputs);
}
