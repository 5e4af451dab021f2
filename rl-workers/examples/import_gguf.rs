//! Imports a llama.cpp GGUF file into a Hugging Face directory: `import_gguf FILE.gguf OUT_DIR`.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [gguf, out] = args.as_slice() else {
        eprintln!("usage: import_gguf FILE.gguf OUT_DIR");
        std::process::exit(2);
    };
    match rl_workers::gguf::import(gguf, out) {
        Ok(report) => println!(
            "imported {} tensors ({:?}) into {} as {} (vocab {}, tied embeddings: {})",
            report.tensors,
            report.source_types,
            report.out_dir.display(),
            report.architecture,
            report.vocab_size,
            report.tie_word_embeddings
        ),
        Err(e) => {
            eprintln!("import_gguf: {e}");
            std::process::exit(1);
        }
    }
}
