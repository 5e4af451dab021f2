//! `ProcessGroup`: a c10d store plus backend, its initialisation from options or the torchrun
//! environment, and the collectives the trainers use.

use std::time::Duration;

use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::ffi;

/// Bytes per bucket in [`ProcessGroup::all_reduce_many`] (DDP's default `bucket_cap_mb = 25`).
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// Which c10d backend moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `ProcessGroupGloo`: CPU tensors, TCP between hosts.
    Gloo,
    /// `ProcessGroupNCCL`: CUDA tensors; only in builds against a CUDA libtorch with NCCL headers.
    Nccl,
}

impl Backend {
    /// NCCL when this build has it and CUDA is available, otherwise Gloo (torch's own default).
    pub fn default_for_machine() -> Self {
        if ffi::has_nccl() && tch::Cuda::is_available() {
            Backend::Nccl
        } else {
            Backend::Gloo
        }
    }

    /// Whether this build of the crate can create groups on `self`.
    pub fn is_available(self) -> bool {
        match self {
            Backend::Gloo => true,
            Backend::Nccl => ffi::has_nccl(),
        }
    }
}

/// Reduction applied by [`ProcessGroup::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum over ranks.
    Sum,
    /// Sum divided by the world size (floating-point tensors only).
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

/// How to join a group: what torchrun's environment says, spelled out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    /// This process's rank, `0..world_size`; rank 0 hosts the `TCPStore`.
    pub rank: usize,
    /// Number of processes in the group.
    pub world_size: usize,
    /// Rank within this host (picks the CUDA device under NCCL); `rank` when not known.
    pub local_rank: usize,
    /// Host of rank 0's `TCPStore`.
    pub master_addr: String,
    /// Port of rank 0's `TCPStore`.
    pub master_port: u16,
    /// The backend.
    pub backend: Backend,
    /// Bound on rendezvous and on every collective: past it, the call returns `Err`.
    pub timeout: Duration,
}

/// The variables torchrun sets, in the order they are checked.
pub const ENV_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

impl InitOptions {
    /// Reads torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`.
    ///
    /// `LOCAL_RANK` may be absent (then it equals `RANK`); the others are required.
    /// The backend is [`Backend::default_for_machine`].
    pub fn from_env(timeout: Duration) -> Result<Self> {
        Self::from_lookup(|var| std::env::var(var).ok(), timeout)
    }

    /// [`InitOptions::from_env`] over any variable lookup (tests pass a map).
    pub fn from_lookup(
        lookup: impl Fn(&'static str) -> Option<String>,
        timeout: Duration,
    ) -> Result<Self> {
        let get = |var: &'static str| lookup(var).ok_or(Error::MissingEnv { var });
        let parse = |var: &'static str| -> Result<usize> {
            let value = get(var)?;
            value.trim().parse().map_err(|e| Error::InvalidEnv {
                var,
                value: value.clone(),
                reason: format!("{e}"),
            })
        };
        let rank = parse("RANK")?;
        let world_size = parse("WORLD_SIZE")?;
        let local_rank = match lookup("LOCAL_RANK") {
            Some(_) => parse("LOCAL_RANK")?,
            None => rank,
        };
        let master_addr = get("MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(Error::InvalidEnv {
                var: "MASTER_ADDR",
                value: master_addr,
                reason: "empty host".to_owned(),
            });
        }
        let port = get("MASTER_PORT")?;
        let master_port = port.trim().parse().map_err(|e| Error::InvalidEnv {
            var: "MASTER_PORT",
            value: port.clone(),
            reason: format!("{e} (expected a TCP port, 1 to 65535)"),
        })?;
        if world_size == 0 {
            return Err(Error::InvalidEnv {
                var: "WORLD_SIZE",
                value: "0".to_owned(),
                reason: "the world needs at least one rank".to_owned(),
            });
        }
        if rank >= world_size {
            return Err(Error::InvalidEnv {
                var: "RANK",
                value: rank.to_string(),
                reason: format!("must be below WORLD_SIZE={world_size}"),
            });
        }
        Ok(InitOptions {
            rank,
            world_size,
            local_rank,
            master_addr: master_addr.trim().to_owned(),
            master_port,
            backend: Backend::default_for_machine(),
            timeout,
        })
    }
}

/// One member of a data-parallel group: the c10d `TCPStore` it joined and its backend.
///
/// Every rank must call the same collectives in the same order with tensors of the same shape and
/// dtype; c10d matches them up by order.
/// After any `Err` from a collective the group is broken (a peer died or timed out): drop it.
pub struct ProcessGroup {
    raw: ffi::Group,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    backend: Backend,
    timeout: Duration,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("backend", &self.backend)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double
    )
}

fn is_loopback(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl ProcessGroup {
    /// Rendezvous with the other ranks and create the backend; blocks until all `world_size`
    /// ranks have joined or `timeout` passes.
    ///
    /// Gloo binds to the interface named by `GLOO_SOCKET_IFNAME` when set (as in PyTorch), to
    /// 127.0.0.1 when `master_addr` is a loopback address, and otherwise to the address this
    /// host's name resolves to.
    pub fn init(opts: InitOptions) -> Result<Self> {
        let InitOptions {
            rank,
            world_size,
            local_rank,
            ref master_addr,
            master_port,
            backend,
            timeout,
        } = opts;
        let invalid = |reason: String| Error::InvalidArgument {
            rank,
            op: "init",
            reason,
        };
        if world_size == 0 || rank >= world_size {
            return Err(invalid(format!(
                "rank {rank} is not in a world of size {world_size}"
            )));
        }
        if timeout.is_zero() {
            return Err(invalid("timeout must be positive".to_owned()));
        }
        let c_rank = i32::try_from(rank).map_err(|_| invalid("rank too large".to_owned()))?;
        let c_world =
            i32::try_from(world_size).map_err(|_| invalid("world too large".to_owned()))?;
        let code = match backend {
            Backend::Gloo => ffi::BACKEND_GLOO,
            Backend::Nccl => {
                if !ffi::has_nccl() {
                    return Err(invalid(
                        "the nccl backend is not compiled in: rl-dist was built against a CPU-only libtorch (run scripts/setup --cuda and rebuild) or without nccl.h/cuda_runtime.h"
                            .to_owned(),
                    ));
                }
                ffi::BACKEND_NCCL
            }
        };
        let iface = std::env::var("GLOO_SOCKET_IFNAME")
            .ok()
            .filter(|s| !s.is_empty());
        let device = match (&iface, is_loopback(master_addr)) {
            (Some(i), _) => ffi::GlooDevice::Interface(i),
            (None, true) => ffi::GlooDevice::Host("127.0.0.1"),
            (None, false) => ffi::GlooDevice::Default,
        };
        let raw = ffi::Group::new(
            code,
            master_addr,
            master_port,
            c_rank,
            c_world,
            timeout,
            device,
        )
        .map_err(|cause| Error::Collective {
            rank,
            world_size,
            op: "init",
            cause,
        })?;
        Ok(ProcessGroup {
            raw,
            rank,
            world_size,
            local_rank,
            backend,
            timeout,
        })
    }

    /// [`ProcessGroup::init`] with [`InitOptions::from_env`]: how a rank started by torchrun (or
    /// `harness train --nproc-per-node N`) joins its group.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        Self::init(InitOptions::from_env(timeout)?)
    }

    /// This process's rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank within this host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The bound on every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Changes the bound on every later collective (rendezvous often needs a longer one than a
    /// training step's all-reduce).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        if timeout.is_zero() {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: "set_timeout",
                reason: "timeout must be positive".to_owned(),
            });
        }
        self.raw
            .set_timeout(timeout)
            .map_err(self.failed("set_timeout"))?;
        self.timeout = timeout;
        Ok(())
    }

    fn failed(&self, op: &'static str) -> impl FnOnce(String) -> Error {
        let (rank, world_size) = (self.rank, self.world_size);
        move |cause| Error::Collective {
            rank,
            world_size,
            op,
            cause,
        }
    }

    fn tensor_err(&self, op: &'static str) -> impl FnOnce(tch::TchError) -> Error {
        let rank = self.rank;
        move |source| Error::Tensor { rank, op, source }
    }

    fn check_dense(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if !t.is_contiguous() {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op,
                reason: format!("tensor of shape {:?} is not contiguous", t.size()),
            });
        }
        Ok(())
    }

    /// Reduces `tensor` over all ranks in place: afterwards every rank holds the same result.
    ///
    /// # Shapes
    /// - `tensor`: any shape, contiguous, same shape and dtype on every rank; `Avg` needs a
    ///   floating-point dtype
    pub fn all_reduce(&mut self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        const OP: &str = "all_reduce";
        self.check_dense(OP, tensor)?;
        if op == ReduceOp::Avg && !is_float(tensor.kind()) {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: OP,
                reason: format!(
                    "ReduceOp::Avg needs a floating-point tensor, got {:?}",
                    tensor.kind()
                ),
            });
        }
        let code = match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::OP_SUM,
            ReduceOp::Max => ffi::OP_MAX,
            ReduceOp::Min => ffi::OP_MIN,
        };
        self.raw
            .all_reduce(tensor, code, self.timeout)
            .map_err(self.failed(OP))?;
        if op == ReduceOp::Avg {
            // Gloo has no AVG; dividing the sum is what DDP does with its gradient buckets.
            let world = self.world_size as f64;
            tch::no_grad(|| tensor.f_div_scalar_(world).map(drop)).map_err(self.tensor_err(OP))?;
        }
        Ok(())
    }

    /// Every rank's `tensor`, in rank order.
    ///
    /// # Shapes
    /// - `tensor`: any shape, same shape and dtype on every rank
    /// - returns `world_size` tensors shaped like `tensor`
    pub fn all_gather(&mut self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        const OP: &str = "all_gather";
        let input = tensor.f_contiguous().map_err(self.tensor_err(OP))?;
        let mut outputs = (0..self.world_size)
            .map(|_| input.f_empty_like())
            .collect::<Result<Vec<_>, _>>()
            .map_err(self.tensor_err(OP))?;
        self.raw
            .all_gather(&mut outputs, &input, self.timeout)
            .map_err(self.failed(OP))?;
        Ok(outputs)
    }

    /// Copies rank `src`'s `tensor` into every rank's `tensor`.
    ///
    /// # Shapes
    /// - `tensor`: any shape, contiguous, same shape and dtype on every rank
    pub fn broadcast(&mut self, tensor: &mut Tensor, src: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_dense(OP, tensor)?;
        if src >= self.world_size {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: OP,
                reason: format!(
                    "source rank {src} is not in a world of size {}",
                    self.world_size
                ),
            });
        }
        let src = i32::try_from(src).unwrap_or(i32::MAX);
        self.raw
            .broadcast(tensor, src, self.timeout)
            .map_err(self.failed(OP))
    }

    /// Reduces every rank's 1-D `input` and hands rank `r` the elements `[r * n, (r + 1) * n)`
    /// of the result, `n = input.numel() / world_size` (ZeRO's gradient reduce-scatter).
    ///
    /// # Shapes
    /// - `input`: `[world_size * n]`, the same shape and dtype on every rank; `Avg` needs a
    ///   floating-point dtype
    /// - returns `[n]`
    pub fn reduce_scatter(&mut self, input: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let input = input.f_contiguous().map_err(self.tensor_err(OP))?;
        let numel = input.numel();
        if input.dim() != 1 || !numel.is_multiple_of(self.world_size) {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: OP,
                reason: format!(
                    "needs a 1-D tensor whose length splits over {} ranks, got shape {:?}",
                    self.world_size,
                    input.size()
                ),
            });
        }
        if op == ReduceOp::Avg && !is_float(input.kind()) {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op: OP,
                reason: format!(
                    "ReduceOp::Avg needs a floating-point tensor, got {:?}",
                    input.kind()
                ),
            });
        }
        let n = (numel / self.world_size) as i64;
        let mut out =
            Tensor::f_empty([n], (input.kind(), input.device())).map_err(self.tensor_err(OP))?;
        let code = match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::OP_SUM,
            ReduceOp::Max => ffi::OP_MAX,
            ReduceOp::Min => ffi::OP_MIN,
        };
        self.raw
            .reduce_scatter(&mut out, &input, code, self.timeout)
            .map_err(self.failed(OP))?;
        if op == ReduceOp::Avg {
            let world = self.world_size as f64;
            tch::no_grad(|| out.f_div_scalar_(world).map(drop)).map_err(self.tensor_err(OP))?;
        }
        Ok(out)
    }

    /// Every rank's 1-D `input` concatenated in rank order, in one flat tensor (ZeRO's
    /// parameter all-gather).
    ///
    /// # Shapes
    /// - `input`: `[n]`, the same shape and dtype on every rank
    /// - returns `[world_size * n]`
    pub fn all_gather_flat(&mut self, input: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather_flat";
        let (input, mut out) = self.flat_gather_buffers(OP, input)?;
        self.raw
            .all_gather_flat(&mut out, &input, self.timeout)
            .map_err(self.failed(OP))?;
        Ok(out)
    }

    /// [`ProcessGroup::all_gather_flat`] started without waiting: the collective runs on the
    /// backend's threads while the caller computes, and [`PendingGather::wait`] returns its
    /// result (FSDP's prefetch of the next layer). Other collectives may be issued meanwhile;
    /// every rank must issue all of them in the same order.
    pub fn all_gather_flat_start(&mut self, input: &Tensor) -> Result<PendingGather> {
        const OP: &str = "all_gather_flat_start";
        let (input, mut out) = self.flat_gather_buffers(OP, input)?;
        let work = self
            .raw
            .all_gather_flat_start(&mut out, &input, self.timeout)
            .map_err(self.failed(OP))?;
        Ok(PendingGather {
            work,
            out,
            rank: self.rank,
            world_size: self.world_size,
        })
    }

    /// A 1-D contiguous `input` and the `[world_size * n]` output of a flat all-gather.
    fn flat_gather_buffers(&self, op: &'static str, input: &Tensor) -> Result<(Tensor, Tensor)> {
        let input = input.f_contiguous().map_err(self.tensor_err(op))?;
        if input.dim() != 1 {
            return Err(Error::InvalidArgument {
                rank: self.rank,
                op,
                reason: format!("needs a 1-D tensor, got shape {:?}", input.size()),
            });
        }
        let total = input.numel() as i64 * self.world_size as i64;
        let out = Tensor::f_empty([total], (input.kind(), input.device()))
            .map_err(self.tensor_err(op))?;
        Ok((input, out))
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&mut self) -> Result<()> {
        self.raw
            .barrier(self.timeout)
            .map_err(self.failed("barrier"))
    }

    /// [`ProcessGroup::all_reduce`] of many tensors (gradients), flattened into buckets of at most
    /// [`DEFAULT_BUCKET_BYTES`] per dtype and device, so small tensors share one collective.
    /// Equals reducing each tensor on its own.
    ///
    /// # Shapes
    /// - `tensors`: any shapes; the same list of shapes and dtypes, in the same order, on every rank
    pub fn all_reduce_many(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.all_reduce_bucketed(tensors, op, DEFAULT_BUCKET_BYTES)
    }

    /// [`ProcessGroup::all_reduce_many`] with an explicit bucket size in bytes (a tensor larger
    /// than `bucket_bytes` gets a bucket of its own).
    ///
    /// # Shapes
    /// - `tensors`: any shapes; the same list of shapes and dtypes, in the same order, on every rank
    pub fn all_reduce_bucketed(
        &mut self,
        tensors: &mut [Tensor],
        op: ReduceOp,
        bucket_bytes: usize,
    ) -> Result<()> {
        const OP: &str = "all_reduce_many";
        for (kind, _device, bucket) in plan_buckets(tensors, bucket_bytes) {
            if op == ReduceOp::Avg && !is_float(kind) {
                return Err(Error::InvalidArgument {
                    rank: self.rank,
                    op: OP,
                    reason: format!("ReduceOp::Avg needs floating-point tensors, got {kind:?}"),
                });
            }
            if let [i] = bucket[..]
                && tensors[i].is_contiguous()
            {
                self.all_reduce(&mut tensors[i], op)
                    .map_err(|e| relabel(e, OP))?;
                continue;
            }
            let flat = tch::no_grad(|| {
                let parts = bucket
                    .iter()
                    .map(|&i| tensors[i].f_reshape([-1]))
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::f_cat(&parts, 0)
            });
            let mut flat = flat.map_err(self.tensor_err(OP))?;
            self.all_reduce(&mut flat, op).map_err(|e| relabel(e, OP))?;
            let mut offset = 0i64;
            for &i in &bucket {
                let t = &mut tensors[i];
                let numel = t.numel() as i64;
                tch::no_grad(|| {
                    let part = flat
                        .f_narrow(0, offset, numel)?
                        .f_view(t.size().as_slice())?;
                    t.f_copy_(&part)
                })
                .map_err(self.tensor_err(OP))?;
                offset += numel;
            }
        }
        Ok(())
    }
}

/// Reports a failure inside `all_reduce_many` under its own name.
fn relabel(e: Error, op: &'static str) -> Error {
    match e {
        Error::Collective {
            rank,
            world_size,
            cause,
            ..
        } => Error::Collective {
            rank,
            world_size,
            op,
            cause,
        },
        Error::InvalidArgument { rank, reason, .. } => Error::InvalidArgument { rank, op, reason },
        Error::Tensor { rank, source, .. } => Error::Tensor { rank, op, source },
        other => other,
    }
}

/// Groups tensor indices into buckets of one dtype and device, in first-seen order, each at most
/// `bucket_bytes` (or one oversized tensor): the same plan on every rank for the same list.
fn plan_buckets(tensors: &[Tensor], bucket_bytes: usize) -> Vec<(Kind, tch::Device, Vec<usize>)> {
    let mut open: Vec<(Kind, tch::Device, Vec<usize>, usize)> = Vec::new();
    let mut done = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let (kind, device) = (t.kind(), t.device());
        let bytes = t.numel() * kind.elt_size_in_bytes();
        let slot = open
            .iter()
            .position(|(k, d, ..)| *k == kind && *d == device);
        match slot {
            Some(s) if open[s].3 + bytes <= bucket_bytes => {
                open[s].2.push(i);
                open[s].3 += bytes;
            }
            Some(s) => {
                let (k, d, idx, _) =
                    std::mem::replace(&mut open[s], (kind, device, vec![i], bytes));
                done.push((k, d, idx));
            }
            None => open.push((kind, device, vec![i], bytes)),
        }
    }
    done.extend(open.into_iter().map(|(k, d, idx, _)| (k, d, idx)));
    done
}

/// A flat all-gather in flight ([`ProcessGroup::all_gather_flat_start`]).
pub struct PendingGather {
    work: ffi::Work,
    out: Tensor,
    rank: usize,
    world_size: usize,
}

impl std::fmt::Debug for PendingGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingGather")
            .field("rank", &self.rank)
            .field("out", &self.out.size())
            .finish()
    }
}

impl PendingGather {
    /// Waits for the collective: every rank's input concatenated in rank order.
    pub fn wait(mut self) -> Result<Tensor> {
        let (rank, world_size) = (self.rank, self.world_size);
        self.work.wait().map_err(|cause| Error::Collective {
            rank,
            world_size,
            op: "all_gather_flat_start",
            cause,
        })?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn torchrun_env() -> HashMap<&'static str, String> {
        [
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.7"),
        ]
        .into_iter()
        .chain([("MASTER_PORT", "29500")])
        .map(|(k, v)| (k, v.to_owned()))
        .collect()
    }

    fn parse(env: &HashMap<&'static str, String>) -> Result<InitOptions> {
        InitOptions::from_lookup(|var| env.get(var).cloned(), Duration::from_secs(1))
    }

    #[test]
    fn torchrun_variables_become_init_options() {
        let opts = parse(&torchrun_env()).unwrap();
        assert_eq!((opts.rank, opts.world_size, opts.local_rank), (1, 4, 1));
        assert_eq!(
            (opts.master_addr.as_str(), opts.master_port),
            ("10.0.0.7", 29500)
        );
        let mut env = torchrun_env();
        env.remove("LOCAL_RANK");
        assert_eq!(
            parse(&env).unwrap().local_rank,
            1,
            "LOCAL_RANK defaults to RANK"
        );
    }

    #[test]
    fn each_missing_variable_is_named() {
        for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            let mut env = torchrun_env();
            env.remove(var);
            let err = parse(&env).unwrap_err();
            assert!(
                matches!(err, Error::MissingEnv { var: v } if v == var),
                "{err:?}"
            );
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn malformed_variables_are_named() {
        for (var, value) in [
            ("RANK", "one"),
            ("RANK", "4"),
            ("WORLD_SIZE", "0"),
            ("LOCAL_RANK", "-1"),
            ("MASTER_PORT", "70000"),
            ("MASTER_PORT", "http"),
            ("MASTER_ADDR", " "),
        ] {
            let mut env = torchrun_env();
            env.insert(var, value.to_owned());
            let err = parse(&env).unwrap_err();
            assert!(
                matches!(err, Error::InvalidEnv { var: v, .. } if v == var),
                "{var}={value}: {err:?}"
            );
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn nccl_on_a_cpu_only_build_is_a_clear_error() {
        if Backend::Nccl.is_available() {
            return;
        }
        let opts = InitOptions {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".to_owned(),
            master_port: 1,
            backend: Backend::Nccl,
            timeout: Duration::from_secs(1),
        };
        let err = ProcessGroup::init(opts).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    rank: 0,
                    op: "init",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("nccl"), "{err}");
    }

    #[test]
    fn rank_outside_the_world_is_rejected_before_any_network() {
        let opts = InitOptions {
            rank: 2,
            world_size: 2,
            local_rank: 0,
            master_addr: "127.0.0.1".to_owned(),
            master_port: 1,
            backend: Backend::Gloo,
            timeout: Duration::from_secs(1),
        };
        assert!(matches!(
            ProcessGroup::init(opts),
            Err(Error::InvalidArgument {
                rank: 2,
                op: "init",
                ..
            })
        ));
    }

    #[test]
    fn buckets_keep_order_split_by_dtype_and_respect_the_cap() {
        let f = |n: i64, k: Kind| Tensor::zeros([n], (k, tch::Device::Cpu));
        let ts = [
            f(10, Kind::Float),  // 40 B
            f(3, Kind::Int64),   // 24 B
            f(10, Kind::Float),  // 40 B -> fits with the first (80 <= 100)
            f(10, Kind::Float),  // 40 B -> new float bucket
            f(100, Kind::Float), // 400 B, oversized: its own bucket
            f(2, Kind::Int64),
        ];
        let plan: Vec<Vec<usize>> = plan_buckets(&ts, 100)
            .into_iter()
            .map(|(_, _, idx)| idx)
            .collect();
        assert_eq!(plan, vec![vec![0, 2], vec![3], vec![4], vec![1, 5]]);
        let mut all: Vec<usize> = plan.concat();
        all.sort_unstable();
        assert_eq!(
            all,
            (0..ts.len()).collect::<Vec<_>>(),
            "every tensor exactly once"
        );
    }
}
