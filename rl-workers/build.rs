//! Compiles the C++ shim (`csrc/`: the oneDNN linear layer of `src/gemm.rs` and the decode
//! step's attention of `src/model.rs`) against the libtorch headers that tch builds with
//! (`LIBTORCH`, which `.cargo/config.toml` sets). The attention splits its work with
//! `at::parallel_for`, which libtorch's headers implement with OpenMP: hence `-fopenmp` and
//! libgomp, the OpenMP runtime libtorch itself loads (the same `libgomp.so.1`, so one thread
//! pool).

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc");
    for var in ["LIBTORCH", "LIBTORCH_CXX11_ABI"] {
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
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(libtorch.join("include"))
        .include(libtorch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={cxx11_abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-fopenmp")
        // results unchanged (nothing here reads floating-point exception flags), and GCC may
        // then turn the clamps of SiLU's exponential into vector selects below AVX-512
        .flag("-fno-trapping-math")
        // the kernels' vector helpers take 64-byte vectors by value, inlined within their own
        // file; GCC's note that such calls changed ABI in GCC 4.6 concerns no interface here
        .flag("-Wno-psabi")
        .file("csrc/onednn_linear.cpp")
        .file("csrc/decode_attention.cpp")
        .file("csrc/fused_ops.cpp")
        .compile("rl_workers_shim");
    println!("cargo:rustc-link-lib=dylib=gomp");
}
