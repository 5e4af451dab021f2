//! Data-parallel collectives over PyTorch's own c10d: rendezvous through `TCPStore`, Gloo on CPU and
//! NCCL on CUDA, initialised from the torchrun environment.
