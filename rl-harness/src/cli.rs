//! The `harness` command line (clap) and what each subcommand does.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::Value;

use crate::analysis::compare::{self, Mode};
use crate::analysis::listing;
use crate::analysis::sweep;
use crate::config::{self, Override, Sources};
use crate::integrations::tracker;
use crate::run::rank::{self, Membership};
use crate::run::train;
use crate::store::{RunRow, Store, filter};

/// Trains, resumes, sweeps and compares RL post-training runs; every run is recorded in a
/// SQLite run store.
#[derive(Debug, Parser)]
#[command(name = "harness", version, about, long_about = None)]
pub struct Cli {
    /// The run store (default: `RL_TRAINER__DB`, else `runs/harness.db`; for `train`, this
    /// overrides `trainer.db`).
    #[arg(long, global = true, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start a run: `harness train experiments/quickstart.toml trainer.total_training_steps=20`.
    Train(TrainArgs),
    /// Validate a model and record the scores as a run (`train` with
    /// `trainer.total_training_steps=0 trainer.val_before_train=true`).
    Eval(TrainArgs),
    /// Continue a run from its latest complete checkpoint (or from `--from-step`).
    Resume {
        /// Run id or name.
        run: String,
        /// Resume from the checkpoint at this step instead of the latest.
        #[arg(long)]
        from_step: Option<u64>,
        /// `key.path=value` changes; only resume-safe keys may change.
        overrides: Vec<String>,
        /// Data-parallel ranks to continue on, on this machine (as `harness train`); a
        /// checkpoint resumes at any world size.
        #[arg(long, default_value_t = 1, value_name = "N")]
        nproc_per_node: usize,
        /// Seconds a rank waits for the others before failing (as `harness train`).
        #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
        dist_timeout_s: f64,
    },
    /// Run (or continue) a sweep: finished trials are skipped, interrupted ones resumed.
    Sweep {
        /// A sweep file: an experiment plus a `[sweep]` table.
        file: PathBuf,
        /// Trials at once (bounded by cores and devices).
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        /// Run failed trials again.
        #[arg(long)]
        retry_failed: bool,
    },
    /// List runs.
    Runs {
        /// Keep runs matching an expression over config keys, final metrics and run fields:
        /// `algorithm.adv_estimator = 'grpo' and val/test_score > 0.5`.
        #[arg(long)]
        filter: Option<String>,
        /// Only this sweep's runs (its id, or its name for the latest sweep of that name).
        #[arg(long)]
        sweep: Option<String>,
        /// Only this project's runs (`trainer.project_name`).
        #[arg(long)]
        project: Option<String>,
        /// Only the newest N runs (after the other selections).
        #[arg(long)]
        limit: Option<usize>,
        /// Also the runs that failed before their first step (bad inputs), hidden otherwise.
        #[arg(long)]
        all: bool,
    },
    /// Show one run: status, config, final metrics, checkpoints, events.
    Show {
        /// Run id or name.
        run: String,
        /// Also print the validation generations it recorded (`trainer.log_val_generations`).
        #[arg(long)]
        generations: bool,
        /// Print every config group, also those left at their defaults.
        #[arg(long)]
        full: bool,
    },
    /// Compare runs (metrics table, config differences, plots), or rank a sweep's trials.
    Compare(CompareArgs),
    /// Export a run's metrics.
    Export {
        /// Run id or name.
        run: String,
        /// Output format.
        #[arg(long, value_enum)]
        format: ExportFormat,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Push records still pending for the remote tracker.
    Sync {
        /// Tracker address to use instead of the one each run recorded.
        #[arg(long)]
        uri: Option<String>,
        /// Seconds for the whole sync.
        #[arg(long, default_value_t = 120.0)]
        timeout_s: f64,
    },
    /// Estimate the memory a run needs before starting it (parameters, weights, gradients,
    /// optimizer state, reference, critic, KV cache, activations), from the resolved config and
    /// the model's config.json; no weights are read.
    Plan(PlanArgs),
    /// Inspect configs.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Make datasets (verl-schema parquet).
    #[command(subcommand)]
    Data(DataCommand),
    /// Import models.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Browse the run store in a web browser: runs table, metric charts, run pages, config
    /// diffs, sweep rankings; read-only, served by this binary (127.0.0.1 by default).
    Ui {
        /// The address to listen on; anything but a loopback address lets other machines read
        /// every run (there is no authentication).
        #[arg(long, default_value = "127.0.0.1")]
        host: std::net::IpAddr,
        /// The port (0: any free one; the printed address says which).
        #[arg(long, default_value_t = 8765)]
        port: u16,
    },
    /// The BM25 retriever of search-augmented training (Search-R1's protocol).
    #[command(subcommand)]
    Retriever(crate::integrations::retriever::RetrieverCommand),
    /// Serve a model with the OpenAI API (completions, chat, streaming, token ids and log-probs)
    /// over a continuous-batching engine: `harness serve runs/3-quickstart-grpo/model --port 8000`
    Serve(crate::serve::ServeArgs),
}

/// `harness train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The experiment TOML file.
    pub config: PathBuf,
    /// `key.path=value` overrides, applied last.
    pub overrides: Vec<String>,
    /// The sweep this run is a trial of (set by `harness sweep`).
    #[arg(long, hide = true)]
    pub sweep_id: Option<String>,
    /// The trial id (set by `harness sweep`).
    #[arg(long, hide = true)]
    pub trial_id: Option<String>,
    /// Data-parallel ranks to start on this machine, each a copy of this program with torchrun's
    /// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); 1 trains in this process. Under
    /// torchrun, Slurm or Kubernetes leave it out: with WORLD_SIZE set, this process is a rank.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub nproc_per_node: usize,
    /// Seconds a rank waits for the others (rendezvous and every collective) before failing;
    /// also how long the launcher gives the other ranks to stop after one dies.
    #[arg(long, default_value_t = 300.0, value_name = "SECONDS")]
    pub dist_timeout_s: f64,
}

impl TrainArgs {
    /// The command line of one rank: this one without `--nproc-per-node`.
    fn rank_args(&self, db: &Option<PathBuf>) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = Vec::new();
        if let Some(d) = db {
            args.extend(["--db".into(), d.clone().into_os_string()]);
        }
        args.extend(["train".into(), self.config.clone().into_os_string()]);
        args.extend(self.overrides.iter().map(Into::into));
        args.extend([
            "--dist-timeout-s".into(),
            self.dist_timeout_s.to_string().into(),
        ]);
        for (flag, v) in [
            ("--sweep-id", &self.sweep_id),
            ("--trial-id", &self.trial_id),
        ] {
            if let Some(v) = v {
                args.extend([flag.into(), v.into()]);
            }
        }
        args
    }
}

/// `harness plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The experiment TOML file (resolved as `harness train` resolves it).
    pub config: PathBuf,
    /// `key.path=value` overrides, applied last.
    pub overrides: Vec<String>,
    /// Estimate for a public model shape instead of `actor_rollout_ref.model.path`'s
    /// config.json: Qwen2.5-0.5B, 1.5B or 7B-Instruct.
    #[arg(long, value_enum, value_name = "SIZE")]
    pub model_size: Option<crate::analysis::plan::ModelSize>,
}

/// `harness compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Run ids or names.
    pub runs: Vec<String>,
    /// Metrics to compare (repeatable); default: every metric all runs share.
    #[arg(long = "metric")]
    pub metrics: Vec<String>,
    /// Rank this sweep's trials (its id, or its `[sweep] name` for the latest such sweep) by
    /// the first `--metric` (default: the sweep's metric).
    #[arg(long)]
    pub sweep: Option<String>,
    /// Also show each metric's value at this step.
    #[arg(long)]
    pub at_step: Option<i64>,
    /// Whether larger is better.
    #[arg(long, value_enum, default_value_t = Mode::Auto)]
    pub mode: Mode,
    /// Plot the metric curves to this .svg or .png file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Exponential smoothing weight for the plot, in [0, 1).
    #[arg(long, default_value_t = 0.0)]
    pub smooth: f64,
}

/// Export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// `run_id,step,key,value,wall_time`, one metric per line.
    Csv,
    /// One JSON object per step: `{"step": .., "wall_time": .., "metrics": {..}}`.
    Jsonl,
}

/// `harness config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the resolved config (defaults → file → RL_ env → overrides) as TOML.
    Show {
        /// The experiment TOML file.
        config: PathBuf,
        /// `key.path=value` overrides.
        overrides: Vec<String>,
    },
    /// Print every config key with its default, as Markdown (docs/config.md).
    Reference,
    /// Turn a verl run into this harness's TOML: a `python3 -m verl.trainer.main_ppo key=value
    /// ...` command line (or a script running one), or verl's resolved YAML config (.yaml).
    /// Says what it mapped, what has no effect here and what it refused; refused keys make
    /// the exit status 1 (the TOML is written without them).
    FromVerl {
        /// The script or command-line file, the .yaml config, or the command line itself
        /// (quoted as one argument); `-` reads standard input.
        input: PathBuf,
        /// Write the TOML here instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The script's arguments (`$1`, `$2`, ... and `"$@"`), as it would be run with them.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Split sizes and seed of a generator.
#[derive(Debug, Args)]
pub struct GenArgs {
    /// Output folder (train.parquet and test.parquet are written there).
    pub out_dir: PathBuf,
    /// Training rows.
    #[arg(long, default_value_t = 1000)]
    pub train: usize,
    /// Test rows.
    #[arg(long, default_value_t = 100)]
    pub test: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `harness data ...`.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Turn GSM8K's jsonl files (train.jsonl, test.jsonl in SRC_DIR) into verl-schema parquet.
    Gsm8k {
        /// Folder holding GSM8K's train.jsonl and test.jsonl.
        src_dir: PathBuf,
        /// Output folder.
        out_dir: PathBuf,
    },
    /// Seeded arithmetic problems.
    Arithmetic {
        /// Sizes, seed, output.
        #[command(flatten)]
        gen_args: GenArgs,
        /// Most digits per operand.
        #[arg(long)]
        digits: Option<u32>,
        /// Operands per expression.
        #[arg(long)]
        operands: Option<usize>,
    },
    /// Seeded countdown problems (TinyZero's task).
    Countdown {
        /// Sizes, seed, output.
        #[command(flatten)]
        gen_args: GenArgs,
    },
    /// Seeded two-step word problems in GSM8K's format (`#### N`), scored by verl's strict
    /// GSM8K scorer.
    WordProblems {
        /// Sizes, seed, output.
        #[command(flatten)]
        gen_args: GenArgs,
        /// Problem kinds (0 to 7, comma-separated; each a two-step problem of its own shape)
        /// kept for the test split: training never sees them and the test split has only them.
        /// Default: every kind in both splits.
        #[arg(long, value_delimiter = ',')]
        test_kinds: Vec<usize>,
        /// The wording (0 to 2) of every kind kept for the test split: test problems are of
        /// kinds seen in training, in words never seen there. Default: every wording in both.
        #[arg(long)]
        test_phrasing: Option<usize>,
    },
    /// Seeded two-operand addition with short prompts, for the tiny character-level model
    /// (`harness model init-tiny`): carry-free and zero-padded unless told otherwise.
    TinyAddition {
        /// Sizes, seed, output.
        #[command(flatten)]
        gen_args: GenArgs,
        /// Largest operand.
        #[arg(long, default_value_t = 99)]
        max_operand: i64,
        /// Allow sums with carries (harder).
        #[arg(long)]
        carry: bool,
        /// Do not zero-pad operands to a fixed width.
        #[arg(long)]
        no_zero_pad: bool,
        /// Also write train_pairs.parquet and test_pairs.parquet: the right sum as `chosen`,
        /// a wrong one as `rejected` (TRL's preference schema, for offline DPO).
        #[arg(long)]
        pairs: bool,
    },
    /// The synthetic search task (Search-R1 style): a corpus of facts about invented
    /// entities, its BM25 index, train/test questions about disjoint entities and SFT
    /// search-then-answer traces.
    SearchTask(crate::integrations::retriever::SearchTaskArgs),
    /// Turn QA JSON lines (`{"question", "golden_answers"}`) into Search-R1 parquet.
    SearchR1(crate::integrations::retriever::SearchR1Args),
}

/// `harness model ...`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Import a llama GGUF file into a Hugging Face folder (config.json, model.safetensors,
    /// tokenizer.json, tokenizer_config.json).
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// The output folder.
        out_dir: PathBuf,
    },
    /// Write a tiny randomly initialised Llama (hidden 64, 2 layers, 4 heads) with the
    /// character-level tokenizer as a Hugging Face folder: trains in seconds on a CPU.
    InitTiny {
        /// The output folder.
        out_dir: PathBuf,
        /// Seed of the initial weights.
        #[arg(long, default_value_t = 0)]
        seed: i64,
        /// Multiply every initial weight by `1 + NOISE * N(0, 1)`: the same model up to a
        /// relative perturbation (e.g. 1e-6), to check that a recipe does not ride one exact
        /// float trajectory.
        #[arg(long, default_value_t = 0.0)]
        noise: f64,
    },
}

fn default_db(cli_db: &Option<PathBuf>) -> PathBuf {
    cli_db
        .clone()
        .or_else(|| std::env::var_os("RL_TRAINER__DB").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("runs/harness.db"))
}

fn parse_overrides(args: &[String]) -> Result<Vec<Override>> {
    args.iter().map(|a| Override::parse(a)).collect()
}

/// Runs the parsed command line.
pub(crate) fn run(cli: Cli) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let db = default_db(&cli.db);
    let command = match cli.command {
        Command::Eval(mut a) => {
            a.overrides.extend([
                "trainer.total_training_steps=0".to_string(),
                "trainer.val_before_train=true".to_string(),
            ]);
            Command::Train(a)
        }
        other => other,
    };
    match command {
        // an eval is a train by now (see above)
        Command::Train(a) | Command::Eval(a) => {
            let mut overrides = parse_overrides(&a.overrides)?;
            if let Some(d) = &cli.db {
                overrides.push(Override::set(
                    "trainer.db",
                    toml::Value::String(d.display().to_string()),
                ));
            }
            let cfg = config::load(&Sources {
                file: Some(a.config.clone()),
                env: true,
                overrides,
            })?;
            let cfg_db = cfg.trainer.db_path();
            let member = Membership {
                sweep_id: a.sweep_id.clone(),
                trial_id: a.trial_id.clone(),
            };
            let timeout = rank::timeout(a.dist_timeout_s)?;
            let id = if a.nproc_per_node != 1 {
                let args = a.rank_args(&cli.db);
                crate::run::launch::launch(&rt, cfg, member, a.nproc_per_node, timeout, &args)?
            } else if let Some(me) = rank::rank_from_env(timeout)? {
                let id = train::train_rank(&rt, cfg, member, &me)?;
                // the launcher (HARNESS_RUN_ID) reports the run itself; under an outside
                // launcher rank 0 does
                if me.rank != 0 || me.run_id.is_some() {
                    return Ok(());
                }
                id
            } else {
                train::train(&rt, cfg, member)?
            };
            outln!("run {id} finished");
            rt.block_on(print_validation_summary(&cfg_db, id))?;
        }
        Command::Resume {
            run,
            from_step,
            overrides,
            nproc_per_node,
            dist_timeout_s,
        } => {
            let parsed = parse_overrides(&overrides)?;
            let timeout = rank::timeout(dist_timeout_s)?;
            let id = if nproc_per_node != 1 {
                // each rank: this command line without --nproc-per-node
                let mut args: Vec<std::ffi::OsString> = Vec::new();
                if let Some(d) = &cli.db {
                    args.extend(["--db".into(), d.clone().into_os_string()]);
                }
                args.extend(["resume".into(), run.clone().into()]);
                if let Some(s) = from_step {
                    args.extend(["--from-step".into(), s.to_string().into()]);
                }
                args.extend(overrides.iter().map(Into::into));
                args.extend(["--dist-timeout-s".into(), dist_timeout_s.to_string().into()]);
                crate::run::launch::launch_resume(
                    &rt,
                    &db,
                    &run,
                    (from_step, &parsed),
                    nproc_per_node,
                    timeout,
                    &args,
                )?
            } else if let Some(me) = rank::rank_from_env(timeout)? {
                match train::resume_rank(&rt, &db, &run, from_step, &parsed, &me)? {
                    Some(id) if me.run_id.is_none() => id,
                    _ => return Ok(()),
                }
            } else {
                train::resume(&rt, &db, &run, from_step, &parsed)?
            };
            outln!("run {id} finished");
            rt.block_on(print_validation_summary(&db, id))?;
        }
        Command::Sweep {
            file,
            parallel,
            retry_failed,
        } => {
            let r = sweep::run(&rt, &file, parallel, retry_failed, cli.db.as_deref())?;
            outln!(
                "sweep {}: {} skipped, {} started, {} resumed; {} finished, {} failed",
                r.id,
                r.skipped,
                r.started,
                r.resumed,
                r.finished,
                r.failed
            );
            if r.failed > 0 {
                note!(
                    "harness: see `harness compare --sweep {}` and `harness show RUN` for the failures",
                    r.id
                );
            }
        }
        Command::Runs {
            filter,
            sweep,
            project,
            limit,
            all,
        } => rt.block_on(list_runs(
            &db,
            &RunsQuery {
                filter: filter.as_deref(),
                sweep: sweep.as_deref(),
                project: project.as_deref(),
                limit,
                all,
            },
        ))?,
        Command::Show {
            run,
            generations,
            full,
        } => rt.block_on(show(&db, &run, generations, full))?,
        Command::Compare(a) => rt.block_on(compare_cmd(&db, a))?,
        Command::Export { run, format, out } => {
            rt.block_on(export(&db, &run, format, out.as_deref()))?
        }
        Command::Sync { uri, timeout_s } => {
            let store = rt.block_on(Store::open(&db))?;
            let done = rt.block_on(tracker::sync_all(
                &store,
                uri.as_deref(),
                Duration::from_secs(10),
                Duration::try_from_secs_f64(timeout_s.max(0.0)).map_err(|_| {
                    anyhow::anyhow!("--timeout-s must be a number of seconds, got {timeout_s}")
                })?,
            ))?;
            if done.is_empty() {
                outln!("nothing pending");
            }
            for (run, p) in done {
                outln!(
                    "run {run}: pushed {} records and {} metrics",
                    p.records,
                    p.metrics
                );
            }
        }
        Command::Plan(a) => {
            crate::analysis::plan::run(a.config, parse_overrides(&a.overrides)?, a.model_size)?
        }
        Command::Config(ConfigCommand::Show {
            config: file,
            overrides,
        }) => {
            let cfg = config::load(&Sources {
                file: Some(file),
                env: true,
                overrides: parse_overrides(&overrides)?,
            })?;
            out!("{}", config::to_toml(&cfg)?);
        }
        Command::Config(ConfigCommand::Reference) => out!("{}", config::reference_markdown()),
        Command::Config(ConfigCommand::FromVerl { input, out, args }) => {
            from_verl(&input, out.as_deref(), &args)?
        }
        Command::Data(d) => data(d)?,
        Command::Retriever(c) => crate::integrations::retriever::run(c)?,
        Command::Serve(args) => crate::serve::run(&args)?,
        Command::Ui { host, port } => {
            rt.block_on(crate::ui::serve(crate::ui::Options { db, host, port }))?
        }
        Command::Model(ModelCommand::InitTiny {
            out_dir,
            seed,
            noise,
        }) => {
            let n = crate::run::compose::init_tiny(&out_dir, seed, noise)?;
            outln!(
                "{}: tiny Llama, {n} parameters, character-level tokenizer",
                out_dir.display()
            );
        }
        Command::Model(ModelCommand::ImportGguf { file, out_dir }) => {
            let r = rl_workers::gguf::import(&file, &out_dir).with_context(|| {
                format!("importing {} into {}", file.display(), out_dir.display())
            })?;
            outln!(
                "{}: {} tensors, vocab {}, {} (tied embeddings: {})",
                r.out_dir.display(),
                r.tensors,
                r.vocab_size,
                r.architecture,
                r.tie_word_embeddings
            );
        }
    }
    Ok(())
}

fn data(d: DataCommand) -> Result<()> {
    use rl_data::tasks::{self, SplitSizes};
    let files = match d {
        DataCommand::SearchTask(a) => return crate::integrations::retriever::search_task(a),
        DataCommand::SearchR1(a) => return crate::integrations::retriever::search_r1(a),
        DataCommand::Gsm8k { src_dir, out_dir } => tasks::preprocess_gsm8k_dir(&src_dir, &out_dir)
            .with_context(|| format!("preprocessing GSM8K from {}", src_dir.display()))?,
        DataCommand::Arithmetic {
            gen_args: g,
            digits,
            operands,
        } => {
            let mut cfg = tasks::ArithmeticConfig::default();
            if let Some(d) = digits {
                cfg.digits = d;
            }
            if let Some(o) = operands {
                cfg.operands = o;
            }
            mkdir(&g.out_dir)?;
            tasks::generate_arithmetic(
                &g.out_dir,
                &cfg,
                SplitSizes {
                    train: g.train,
                    test: g.test,
                },
                g.seed,
            )
            .with_context(|| format!("writing arithmetic data to {}", g.out_dir.display()))?
        }
        DataCommand::Countdown { gen_args: g } => {
            mkdir(&g.out_dir)?;
            tasks::generate_countdown(
                &g.out_dir,
                &Default::default(),
                SplitSizes {
                    train: g.train,
                    test: g.test,
                },
                g.seed,
            )
            .with_context(|| format!("writing countdown data to {}", g.out_dir.display()))?
        }
        DataCommand::WordProblems {
            gen_args: g,
            test_kinds,
            test_phrasing,
        } => {
            mkdir(&g.out_dir)?;
            tasks::generate_word_problems(
                &g.out_dir,
                &tasks::WordProblemsConfig {
                    test_kinds,
                    test_phrasing,
                    ..Default::default()
                },
                SplitSizes {
                    train: g.train,
                    test: g.test,
                },
                g.seed,
            )
            .with_context(|| format!("writing word problems to {}", g.out_dir.display()))?
        }
        DataCommand::TinyAddition {
            gen_args: g,
            max_operand,
            carry,
            no_zero_pad,
            pairs,
        } => {
            mkdir(&g.out_dir)?;
            let task = tasks::tiny_vocab::TinyAddition {
                max_operand,
                no_carry: !carry,
                zero_pad: !no_zero_pad,
            };
            let sizes = SplitSizes {
                train: g.train,
                test: g.test,
            };
            let context = || format!("writing tiny addition data to {}", g.out_dir.display());
            if pairs {
                // generate_tiny_preferences writes generate_tiny_addition's train.parquet and
                // test.parquet first, then the pair files, and returns only the pair files
                let pair_files =
                    tasks::tiny_vocab::generate_tiny_preferences(&g.out_dir, task, sizes, g.seed)
                        .with_context(context)?;
                outln!(
                    "wrote {}, {}, {} and {}",
                    g.out_dir.join("train.parquet").display(),
                    g.out_dir.join("test.parquet").display(),
                    pair_files.train.display(),
                    pair_files.test.display()
                );
                return Ok(());
            }
            tasks::tiny_vocab::generate_tiny_addition(&g.out_dir, task, sizes, g.seed)
                .with_context(context)?
        }
    };
    outln!(
        "wrote {} and {}",
        files.train.display(),
        files.test.display()
    );
    Ok(())
}

/// Prints each validation metric's first and last value (`val/test_score/arithmetic: 0.265 ->
/// 0.545 (step 0 -> 40)`), so a finished run says at once whether it learned.
async fn print_validation_summary(db: &Path, id: i64) -> Result<()> {
    let store = Store::open_read_only(db).await?;
    let all = store.all_metrics(id).await?;
    // key -> ((first step, value), (last step, value))
    type FirstLast = ((i64, f64), (i64, f64));
    let mut seen: BTreeMap<&str, FirstLast> = BTreeMap::new();
    for (step, key, value, _) in &all {
        if !key.starts_with("val/") {
            continue;
        }
        let e = seen
            .entry(key.as_str())
            .or_insert(((*step, *value), (*step, *value)));
        if *step < e.0.0 {
            e.0 = (*step, *value);
        }
        if *step >= e.1.0 {
            e.1 = (*step, *value);
        }
    }
    for (key, ((s0, v0), (s1, v1))) in seen {
        outln!("  {key}: {v0:.4} -> {v1:.4} (step {s0} -> {s1})");
    }
    Ok(())
}

/// `harness config from-verl`.
fn from_verl(input: &Path, out: Option<&Path>, args: &[String]) -> Result<()> {
    let given = input.to_string_lossy();
    let text = if input == Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
            .context("reading standard input")?;
        s
    } else if !input.exists() && given.contains('=') && given.contains(char::is_whitespace) {
        // the command line itself, quoted as one argument
        given.into_owned()
    } else {
        std::fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?
    };
    let yaml = input.extension().is_some_and(|e| e == "yaml" || e == "yml");
    // a script reads the variables bash would give it here: the environment, this directory
    let var = |name: &str| std::env::var(name).ok();
    let env = config::from_verl::ShellEnv {
        var: &var,
        cwd: std::env::current_dir()
            .ok()
            .map(|d| d.to_string_lossy().into_owned()),
        args,
    };
    let t = config::from_verl::translate(&text, yaml, env)
        .with_context(|| format!("translating {}", input.display()))?;
    let header = format!(
        "# From verl: {}\n# `harness config from-verl` mapped {} keys; {} have no effect here, {} \
         were refused (see its output).\n\n",
        input.display(),
        t.mapped.len(),
        t.ignored.len(),
        t.refused.len()
    );
    let toml = format!("{header}{}", t.toml);
    match out {
        Some(path) => {
            std::fs::write(path, &toml).with_context(|| format!("writing {}", path.display()))?
        }
        None => out!("{toml}"),
    }
    note!(
        "from-verl: {} keys mapped, {} with no effect here, {} refused{}",
        t.mapped.len(),
        t.ignored.len(),
        t.refused.len(),
        out.map(|p| format!("; written to {}", p.display()))
            .unwrap_or_default()
    );
    for m in &t.mapped {
        note!("  mapped      {m}");
    }
    for i in &t.ignored {
        note!("  no effect   {i}");
    }
    for r in &t.refused {
        note!("  refused     {r}");
    }
    if let Some(why) = &t.unchecked {
        note!("from-verl: the result does not check yet, to edit before training: {why}");
    }
    if !t.refused.is_empty() {
        bail!(
            "{} verl key(s) refused (listed above); the TOML leaves them out",
            t.refused.len()
        );
    }
    Ok(())
}

fn mkdir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

async fn open_existing(db: &Path) -> Result<Store> {
    if !db.exists() {
        bail!(
            "no run store at {} (train a run first, or pass --db)",
            db.display()
        );
    }
    Store::open_read_only(db).await
}

fn fmt_time(t: Option<f64>) -> String {
    t.map(|t| {
        let secs = t as i64;
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        let y = yoe + era * 400 + i64::from(m <= 2);
        format!(
            "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    })
    .unwrap_or_else(|| "-".into())
}

/// What `harness runs` lists.
struct RunsQuery<'a> {
    filter: Option<&'a str>,
    sweep: Option<&'a str>,
    project: Option<&'a str>,
    limit: Option<usize>,
    all: bool,
}

async fn list_runs(db: &Path, q: &RunsQuery<'_>) -> Result<()> {
    let expr = q.filter.map(filter::parse).transpose()?;
    let store = open_existing(db).await?;
    let sweep = match q.sweep {
        Some(s) => Some(store.resolve_sweep(s).await?),
        None => None,
    };
    let runs = store.runs(sweep.as_deref()).await?;
    if let Some(p) = q.project
        && !runs.iter().any(|r| r.project == p)
    {
        let projects: Vec<String> = runs.iter().map(|r| r.project.clone()).collect();
        let hint = crate::suggest::nearest_key(p, &projects)
            .map(|n| format!("; did you mean `{n}`?"))
            .unwrap_or_default();
        bail!(
            "no run of project {p:?} in {}{hint}",
            store.path().display()
        );
    }
    // each run's lookup table, and every key any run has (to catch a typo in --filter)
    let runs: Vec<RunRow> = runs
        .into_iter()
        .filter(|r| q.project.is_none_or(|p| r.project == p))
        .collect();
    let mut hidden = 0;
    let mut shown = Vec::new();
    for l in listing::filtered(&store, runs, expr.as_ref(), "--filter").await? {
        // a bad input fails a run before its first step: clutter, unless asked for
        if !q.all && l.run.status == "failed" && l.last_step.is_none() {
            hidden += 1;
            continue;
        }
        shown.push((l.run, l.table, l.last_step.unwrap_or(0)));
    }
    if let Some(n) = q.limit {
        let skip = shown.len().saturating_sub(n);
        shown.drain(..skip);
    }
    let mut out = crate::console::stdout();
    writeln!(
        out,
        "{:>5}  {:<24} {:<14} {:<9} {:>7}  {:<19} {:>8}  {:<16} main metric",
        "id", "name", "project", "status", "step", "created", "took", "sweep"
    )?;
    for (r, table, step) in &shown {
        let took = listing::duration_s(r)
            .map(listing::fmt_duration)
            .unwrap_or_else(|| "-".into());
        let metric = listing::main_metric(table)
            .map(|(k, v)| format!("{v:.4} {k}"))
            .unwrap_or_else(|| "-".into());
        writeln!(
            out,
            "{:>5}  {:<24} {:<14} {:<9} {:>7}  {:<19} {:>8}  {:<16} {metric}",
            r.id,
            r.name,
            r.project,
            r.effective_status(),
            step,
            fmt_time(Some(r.created)),
            took,
            r.sweep_id.as_deref().unwrap_or("-"),
        )?;
    }
    if shown.is_empty() {
        writeln!(
            out,
            "(no runs{})",
            if expr.is_some() {
                " match the filter"
            } else {
                ""
            }
        )?;
    }
    if hidden > 0 {
        writeln!(
            out,
            "({hidden} run(s) that failed before their first step not shown; --all lists them)"
        )?;
    }
    Ok(())
}

async fn show(db: &Path, spec: &str, generations: bool, full: bool) -> Result<()> {
    let store = open_existing(db).await?;
    let r = store.resolve_run(spec).await?;
    let mut out = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(out, "run {} ({}), project {}", r.id, r.name, r.project);
    let _ = writeln!(
        out,
        "status      {}{}",
        r.effective_status(),
        if r.effective_status() == "dead" {
            " (stored as running; no heartbeat)"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "run dir     {}", r.run_dir);
    let _ = writeln!(
        out,
        "git         {} {}",
        r.git_commit.as_deref().unwrap_or("-"),
        match r.git_dirty {
            Some(true) => "(dirty)",
            Some(false) => "(clean)",
            None => "",
        }
    );
    let _ = writeln!(out, "host / pid  {} / {}", r.host, r.pid.unwrap_or(-1));
    let _ = writeln!(out, "seed        {}", r.seed);
    let _ = writeln!(out, "created     {}", fmt_time(Some(r.created)));
    let _ = writeln!(out, "started     {}", fmt_time(r.started));
    let _ = writeln!(out, "ended       {}", fmt_time(r.ended));
    let _ = writeln!(out, "heartbeat   {}", fmt_time(r.heartbeat));
    if let Some(s) = &r.sweep_id {
        let _ = writeln!(
            out,
            "sweep       {s} trial {}",
            r.trial_id.as_deref().unwrap_or("-")
        );
    }
    if let Some(s) = r.resumed_from {
        let _ = writeln!(out, "resumed     from step {s}");
    }
    if let Some(e) = &r.error {
        let _ = writeln!(out, "error       {e}");
    }
    let _ = writeln!(out, "\nfinal metrics:");
    for (k, (step, v)) in store.final_metrics(r.id).await? {
        let _ = writeln!(out, "  {k:<32} {v:>14.6}  (step {step})");
    }
    let _ = writeln!(out, "\ncheckpoints:");
    for c in store.checkpoints(r.id).await? {
        let _ = writeln!(out, "  step {:>6}  {}", c.step, c.path);
    }
    if generations {
        let rows = store.generations(r.id).await?;
        let _ = writeln!(out, "\nvalidation generations:");
        if rows.is_empty() {
            let _ = writeln!(
                out,
                "  none recorded (trainer.log_val_generations = 0, or no validation ran)"
            );
        }
        let mut last = None;
        for g in rows {
            if last != Some(g.step) {
                let _ = writeln!(out, "  step {}:", g.step);
                last = Some(g.step);
            }
            let _ = writeln!(out, "    [{}] score {}", g.data_source, g.score);
            let _ = writeln!(
                out,
                "      prompt:   {}",
                g.prompt.replace('\n', "\n                ")
            );
            let _ = writeln!(
                out,
                "      response: {}",
                g.response.replace('\n', "\n                ")
            );
        }
    }
    let events = store.events(r.id).await?;
    if !events.is_empty() {
        let _ = writeln!(out, "\nevents:");
        for e in events {
            let _ = writeln!(
                out,
                "  {}  {:<14} {}",
                fmt_time(Some(e.time)),
                e.kind,
                e.message
            );
        }
    }
    let mut table = toml::Table::new();
    let mut left_out = Vec::new();
    for g in listing::config_groups(&r)? {
        if g.at_default && !full {
            left_out.push(g.name);
        } else {
            table.insert(g.name, g.table);
        }
    }
    let _ = writeln!(out, "\nconfig:\n{}", toml::to_string(&table)?);
    if !left_out.is_empty() {
        let _ = writeln!(
            out,
            "# at their defaults, left out (--full shows them): {}",
            left_out.join(", ")
        );
    }
    out!("{out}");
    Ok(())
}

async fn compare_cmd(db: &Path, a: CompareArgs) -> Result<()> {
    let store = open_existing(db).await?;
    if let Some(sweep_id) = &a.sweep {
        let metric = match a.metrics.first() {
            Some(m) => m.clone(),
            None => {
                let file = sweep::sweep_file(&store, sweep_id).await?;
                file.and_then(|f| sweep::read_spec(&f).ok())
                    .map(|s| s.metric)
                    .unwrap_or_else(|| "val/test_score".into())
            }
        };
        out!(
            "{}",
            compare::rank_sweep(&store, sweep_id, &metric, a.mode).await?
        );
        if a.runs.is_empty() && a.plot.is_none() {
            return Ok(());
        }
    }
    let mut runs = Vec::new();
    for spec in &a.runs {
        runs.push(store.resolve_run(spec).await?);
    }
    if runs.is_empty() {
        if let Some(s) = &a.sweep {
            let id = store.resolve_sweep(s).await?;
            runs = store.runs(Some(&id)).await?;
            if runs.is_empty() {
                bail!("sweep {id} has no runs yet");
            }
        } else {
            bail!("name at least one run to compare (or --sweep ID)");
        }
    }
    let common = compare::common_metrics(&store, &runs).await?;
    let metrics = if a.metrics.is_empty() {
        let main = compare::primary_metrics(&common);
        if main.len() < common.len() {
            note!(
                "harness: comparing {} of the {} metrics the runs share; --metric KEY picks others",
                main.len(),
                common.len()
            );
        }
        main
    } else {
        // a metric no run recorded is a typo, not an empty table or plot
        let mut every = std::collections::BTreeSet::new();
        for r in &runs {
            every.extend(store.metric_keys(r.id).await?);
        }
        let every: Vec<String> = every.into_iter().collect();
        for m in &a.metrics {
            if !every.contains(m) {
                let hint = crate::suggest::nearest_key(m, &every)
                    .map(|n| format!("; did you mean `{n}`?"))
                    .unwrap_or_default();
                bail!("--metric {m}: no run compared recorded it{hint}");
            }
        }
        a.metrics.clone()
    };
    if metrics.is_empty() {
        bail!("the runs compared share no metric (name one with --metric)");
    }
    out!(
        "{}",
        compare::report(&store, &runs, &metrics, a.mode, a.at_step).await?
    );
    if let Some(file) = &a.plot {
        if !(0.0..1.0).contains(&a.smooth) {
            bail!("--smooth must be in [0, 1), got {}", a.smooth);
        }
        let mut curves = Vec::new();
        for m in &metrics {
            let mut per_run = Vec::new();
            for r in &runs {
                per_run.push((format!("{} {}", r.id, r.name), store.series(r.id, m).await?));
            }
            curves.push((m.clone(), per_run));
        }
        compare::plot(file, &curves, a.smooth)?;
        outln!("plot written to {}", file.display());
    }
    Ok(())
}

async fn export(db: &Path, spec: &str, format: ExportFormat, out: Option<&Path>) -> Result<()> {
    let store = open_existing(db).await?;
    let r = store.resolve_run(spec).await?;
    let rows = store.all_metrics(r.id).await?;
    let mut text = String::new();
    use std::fmt::Write as _;
    match format {
        ExportFormat::Csv => {
            text.push_str("run_id,step,key,value,wall_time\n");
            for (step, key, value, wall) in rows {
                let key = if key.contains([',', '"']) {
                    format!("\"{}\"", key.replace('"', "\"\""))
                } else {
                    key
                };
                let _ = writeln!(text, "{},{step},{key},{value},{wall:.3}", r.id);
            }
        }
        ExportFormat::Jsonl => {
            let mut i = 0;
            while i < rows.len() {
                let step = rows[i].0;
                let mut metrics = serde_json::Map::new();
                let mut wall = rows[i].3;
                while i < rows.len() && rows[i].0 == step {
                    let v = rows[i].2;
                    metrics.insert(
                        rows[i].1.clone(),
                        if v.is_finite() {
                            serde_json::json!(v)
                        } else {
                            Value::String(v.to_string())
                        },
                    );
                    wall = wall.max(rows[i].3);
                    i += 1;
                }
                let _ = writeln!(
                    text,
                    "{}",
                    serde_json::json!({"run_id": r.id, "step": step, "wall_time": wall, "metrics": metrics})
                );
            }
        }
    }
    match out {
        Some(p) => std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?,
        None => crate::console::stdout().write_all(text.as_bytes())?,
    }
    Ok(())
}
