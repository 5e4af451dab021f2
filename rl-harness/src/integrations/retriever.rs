//! `harness retriever index|serve` (the BM25 retriever of Search-R1 style training) and the
//! search data commands `harness data search-task|search-r1`.

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use rl_data::tasks::{SearchTask, SearchTaskConfig, SplitSizes};
use rl_tools::retriever::{Retriever, ServeOptions, build_index, start_server};

/// `harness retriever ...`.
#[derive(Debug, Subcommand)]
pub enum RetrieverCommand {
    /// Build a BM25 index of a Search-R1 corpus: JSON lines of
    /// `{"id": "...", "contents": "\"Title\"\ntext"}`.
    Index {
        /// The corpus (JSON lines).
        corpus: PathBuf,
        /// The index folder to create (new or empty).
        dir: PathBuf,
    },
    /// Serve an index on `POST /retrieve` with Search-R1's protocol until stopped; prints
    /// `serving ... at http://HOST:PORT/retrieve` once it listens.
    Serve {
        /// The index folder (`harness retriever index`).
        dir: PathBuf,
        /// The port; 0 picks a free one (printed).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// The address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: IpAddr,
        /// Allow a non-loopback `--host` (the server has no authentication).
        #[arg(long)]
        allow_remote: bool,
        /// Passages per query when a request has no `topk`.
        #[arg(long, default_value_t = 3)]
        topk: usize,
    },
}

/// `harness data search-task`.
#[derive(Debug, Args)]
pub struct SearchTaskArgs {
    /// Output folder: corpus.jsonl, index/, train.parquet, test.parquet, sft.parquet.
    pub out_dir: PathBuf,
    /// Training questions.
    #[arg(long, default_value_t = 1000)]
    pub train: usize,
    /// Test questions (about entities no training question names).
    #[arg(long, default_value_t = 100)]
    pub test: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Passages per search in the SFT traces: use the same `topk` in the search tool's config.
    #[arg(long, default_value_t = 3)]
    pub topk: usize,
    /// Questions per entity, each about a different attribute (1..=3).
    #[arg(long, default_value_t = 3)]
    pub questions_per_entity: usize,
    /// Entities in the corpus no question asks about.
    #[arg(long, default_value_t = 0)]
    pub distractors: usize,
    /// Syllables per invented name (2..=4).
    #[arg(long, default_value_t = 2)]
    pub syllables: usize,
}

/// `harness data search-r1`.
#[derive(Debug, Args)]
pub struct SearchR1Args {
    /// QA JSON lines (`{"id", "question", "golden_answers": [...]}`, FlashRAG's format).
    pub input: PathBuf,
    /// The parquet file to write.
    pub out: PathBuf,
    /// `data_source` of the rows (`nq`, `triviaqa`, `hotpotqa`, ...).
    #[arg(long, default_value = "nq")]
    pub data_source: String,
    /// `extra_info.split`.
    #[arg(long, default_value = "train")]
    pub split: String,
}

/// Runs `harness retriever ...`.
pub(crate) fn run(cmd: RetrieverCommand) -> Result<()> {
    match cmd {
        RetrieverCommand::Index { corpus, dir } => {
            let stats = build_index(&corpus, &dir)
                .with_context(|| format!("indexing {} into {}", corpus.display(), dir.display()))?;
            outln!("{}: {} passages indexed", dir.display(), stats.docs);
        }
        RetrieverCommand::Serve {
            dir,
            port,
            host,
            allow_remote,
            topk,
        } => {
            let opts = ServeOptions {
                addr: SocketAddr::new(host, port),
                allow_remote,
                default_topk: topk,
            };
            let handle = start_server(&dir, &opts)
                .with_context(|| format!("serving the index {}", dir.display()))?;
            outln!(
                "serving {} ({} passages) at {}",
                dir.display(),
                handle.num_docs(),
                handle.url()
            );
            std::io::stdout().flush().context("writing to stdout")?;
            handle.wait();
        }
    }
    Ok(())
}

/// Writes the synthetic search task: corpus, its index, the RL splits and the SFT traces
/// (whose observations come from that index, as the search tool will return them).
pub(crate) fn search_task(a: SearchTaskArgs) -> Result<()> {
    let out = &a.out_dir;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let cfg = SearchTaskConfig {
        questions_per_entity: a.questions_per_entity,
        distractors: a.distractors,
        syllables: a.syllables,
    };
    let sizes = SplitSizes {
        train: a.train,
        test: a.test,
    };
    let task = SearchTask::generate(&cfg, sizes, a.seed).context("generating the search task")?;
    let corpus = out.join("corpus.jsonl");
    task.write_corpus(&corpus)
        .with_context(|| format!("writing {}", corpus.display()))?;
    let index = out.join("index");
    clear_old_index(&index)?;
    let stats = build_index(&corpus, &index)
        .with_context(|| format!("indexing {} into {}", corpus.display(), index.display()))?;
    let retriever = Retriever::open(&index)?;
    let tool = rl_tools::LocalSearchTool::new(retriever, a.topk).context("--topk")?;
    let files = task
        .write(out, &tool)
        .with_context(|| format!("writing the search task to {}", out.display()))?;
    outln!("wrote {} ({} passages)", corpus.display(), stats.docs);
    outln!("wrote {}", index.display());
    outln!(
        "wrote {}, {} and {} (traces with topk = {})",
        files.train.display(),
        files.test.display(),
        files.sft.display(),
        a.topk
    );
    outln!(
        "serve it with `harness retriever serve {}` and use topk = {} in the search tool",
        index.display(),
        a.topk
    );
    Ok(())
}

/// Removes a previous run's index (a folder holding tantivy's meta.json) so the generator can
/// be rerun into the same folder; anything else in the way is an error.
fn clear_old_index(index: &Path) -> Result<()> {
    if !index.exists() {
        return Ok(());
    }
    let empty = std::fs::read_dir(index)
        .with_context(|| format!("reading {}", index.display()))?
        .next()
        .is_none();
    if empty {
        return Ok(());
    }
    if !index.join("meta.json").is_file() {
        bail!(
            "{} exists and is not an index; move it away first",
            index.display()
        );
    }
    std::fs::remove_dir_all(index).with_context(|| format!("removing the old {}", index.display()))
}

/// Writes Search-R1 QA parquet from a QA JSON-lines file.
pub(crate) fn search_r1(a: SearchR1Args) -> Result<()> {
    let n = rl_data::tasks::preprocess_search_r1_qa(&a.input, &a.out, &a.data_source, &a.split)
        .with_context(|| format!("preprocessing {}", a.input.display()))?;
    outln!(
        "wrote {} ({n} rows, data_source {})",
        a.out.display(),
        a.data_source
    );
    Ok(())
}
