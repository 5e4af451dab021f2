//! Compiles the c10d shim (`csrc/c10d_shim.cpp`) against the libtorch headers that tch builds with.
//!
//! Emits `cfg(rl_dist_nccl)` when `$LIBTORCH/lib/libtorch_cuda.so` exists, the same test torch-sys
//! uses to link CUDA; the shim then also needs `nccl.h` and `cuda_runtime.h` on its include path
//! (from `$CUDA_HOME/include` or `$NCCL_INCLUDE_DIR`) to compile the NCCL backend.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(rl_dist_nccl)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc");
    for var in [
        "LIBTORCH",
        "LIBTORCH_CXX11_ABI",
        "CUDA_HOME",
        "NCCL_INCLUDE_DIR",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if env::var_os("DOCS_RS").is_some() {
        return;
    }
    let Some(libtorch) = env::var_os("LIBTORCH").map(PathBuf::from) else {
        // A build-time misconfiguration: torch-sys fails the same way without it.
        println!(
            "cargo:warning=LIBTORCH is not set; run scripts/setup, which .cargo/config.toml points at"
        );
        std::process::exit(1);
    };
    let cxx11_abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(libtorch.join("include"))
        .include(libtorch.join("include/torch/csrc/api/include"))
        // Stand-ins for Gloo's headers, which the wheels do not ship: after libtorch's own.
        .include("csrc/gloo_stub")
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/c10d_shim.cpp");

    if libtorch.join("lib/libtorch_cuda.so").exists() {
        println!("cargo:rustc-cfg=rl_dist_nccl");
        build.define("RL_DIST_NCCL", "1");
        for var in ["CUDA_HOME", "NCCL_INCLUDE_DIR"] {
            if let Some(dir) = env::var_os(var).map(PathBuf::from) {
                let include = if var == "CUDA_HOME" {
                    dir.join("include")
                } else {
                    dir
                };
                build.include(include);
            }
        }
    }
    build.compile("rl_dist_c10d_shim");
}
