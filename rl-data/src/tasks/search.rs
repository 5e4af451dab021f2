//! Search-R1 data: a seeded synthetic search task for CPU (a corpus of facts about invented
//! entities, questions only a search answers, SFT traces with the real observations), and
//! Search-R1's prompt and parquet layout for real QA data (NQ, HotpotQA, ...).
//!
//! The synthetic task writes, into one folder:
//! - `corpus.jsonl`: one fact per line in Search-R1's corpus format,
//!   `{"id": "0", "contents": "\"Bako\"\nBako color is red."}` (title = the entity's name);
//! - `train.parquet`, `test.parquet`: verl's RL schema with Search-R1's shape
//!   (`data_source = "searchR1_synthetic"`, `ability = "fact-reasoning"`,
//!   `reward_model.ground_truth = {"target": [answer]}`, `extra_info = {split, index, entity,
//!   attribute, query}`) plus Search-R1's `question` and `golden_answers` columns; the prompt
//!   is one user message, `What is the color of Bako?\nUse <search>, then <answer>.`;
//! - `sft.parquet`: the train rows plus a `response` column holding the search-then-answer
//!   trace `<search>Bako color</search>` + the search tool's observation for that query +
//!   `<answer>red</answer>`, also in `extra_info.response` (the harness's SFT reads it with
//!   `sft.response_key = "extra_info.response"` and `sft.mask_tags = ["information"]`).
//!
//! Train and test questions are about disjoint entities and every value is drawn uniformly
//! from 8, so a model that does not search is right about 1 time in 8.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, ListBuilder, RecordBatch, StringArray, StringBuilder};
use arrow::datatypes::{Field, Schema};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use rl_core::Tool;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{SplitSizes, TaskRng};
use crate::error::{Error, Result};
use crate::parquet_io::{RlRecord, write_batches, write_rl_parquet};
use crate::tokenizer::Message;

/// `data_source` of the synthetic task (a `searchR1_*` source, scored by exact match).
pub const SEARCH_TASK_DATA_SOURCE: &str = "searchR1_synthetic";

/// The instruction line under each synthetic question: short, for character-level models.
pub const SEARCH_TASK_INSTRUCTION: &str = "Use <search>, then <answer>.";

/// The attributes of an entity and the 8 values each may take.
pub const SEARCH_TASK_ATTRIBUTES: [(&str, [&str; 8]); 3] = [
    (
        "color",
        [
            "red", "blue", "green", "gold", "pink", "gray", "black", "white",
        ],
    ),
    (
        "city",
        [
            "Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito",
        ],
    ),
    (
        "animal",
        ["cat", "dog", "fox", "owl", "bee", "elk", "yak", "ant"],
    ),
];

const CONSONANTS: &[u8] = b"bdfgklmnprstvz";
const VOWELS: &[u8] = b"aeiou";

/// Options of [`SearchTask::generate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SearchTaskConfig {
    /// Questions asked about each entity, each about a different attribute, 1..=3; default 3.
    pub questions_per_entity: usize,
    /// Entities in the corpus that no question asks about; default 0.
    pub distractors: usize,
    /// Consonant-vowel syllables per name (2 gives `Bako`), 2..=4; default 2 (4,900 names,
    /// at most a quarter of which are used).
    pub syllables: usize,
}

impl Default for SearchTaskConfig {
    fn default() -> Self {
        SearchTaskConfig {
            questions_per_entity: 3,
            distractors: 0,
            syllables: 2,
        }
    }
}

/// One invented entity and its attribute values (in [`SEARCH_TASK_ATTRIBUTES`] order).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entity {
    name: String,
    values: Vec<&'static str>,
}

/// One synthetic question: what is `attribute` of `entity`?
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchQuestion {
    /// The entity's name (`Bako`).
    pub entity: String,
    /// The attribute asked (`color`).
    pub attribute: &'static str,
    /// The right answer (`red`).
    pub answer: &'static str,
}

impl SearchQuestion {
    /// `What is the color of Bako?`
    pub fn question(&self) -> String {
        format!("What is the {} of {}?", self.attribute, self.entity)
    }

    /// The user message: the question and [`SEARCH_TASK_INSTRUCTION`] on the next line.
    pub fn prompt(&self) -> String {
        format!("{}\n{SEARCH_TASK_INSTRUCTION}", self.question())
    }

    /// The query of the SFT trace: `Bako color`.
    pub fn query(&self) -> String {
        format!("{} {}", self.entity, self.attribute)
    }

    /// The corpus sentence that answers it: `Bako color is red.`
    pub fn fact(&self) -> String {
        fact(&self.entity, self.attribute, self.answer)
    }

    /// The SFT response: `<search>{query}</search>{observation}<answer>{answer}</answer>`.
    pub fn trace(&self, observation: &str) -> String {
        format!(
            "<search>{}</search>{observation}<answer>{}</answer>",
            self.query(),
            self.answer
        )
    }
}

fn fact(entity: &str, attribute: &str, value: &str) -> String {
    format!("{entity} {attribute} is {value}.")
}

/// The files [`SearchTask::write`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchTaskFiles {
    /// `<dir>/train.parquet`.
    pub train: PathBuf,
    /// `<dir>/test.parquet`.
    pub test: PathBuf,
    /// `<dir>/sft.parquet`: the train rows with a `response` trace.
    pub sft: PathBuf,
}

/// A generated synthetic search task, held in memory until written.
///
/// The corpus must be indexed before the splits are written, because the SFT traces carry the
/// search tool's real observations: [`SearchTask::write_corpus`], index it (rl-tools'
/// `build_index`), then [`SearchTask::write`] with a search tool over that index.
#[derive(Debug, Clone)]
pub struct SearchTask {
    entities: Vec<Entity>,
    /// Questions per split.
    pub train: Vec<SearchQuestion>,
    /// Test questions, about entities no train question names.
    pub test: Vec<SearchQuestion>,
}

impl SearchTask {
    /// Draws the entities and questions; the same seed, sizes and options give the same task.
    pub fn generate(cfg: &SearchTaskConfig, sizes: SplitSizes, seed: u64) -> Result<SearchTask> {
        let bad = |key: &str, message: String| Error::Config {
            key: format!("search_task.{key}"),
            message,
        };
        let n_attr = SEARCH_TASK_ATTRIBUTES.len();
        if !(1..=n_attr).contains(&cfg.questions_per_entity) {
            return Err(bad(
                "questions_per_entity",
                format!("must be in 1..={n_attr}, got {}", cfg.questions_per_entity),
            ));
        }
        if !(2..=4).contains(&cfg.syllables) {
            return Err(bad(
                "syllables",
                format!("must be in 2..=4, got {}", cfg.syllables),
            ));
        }
        if sizes.train == 0 || sizes.test == 0 {
            return Err(bad(
                "sizes",
                format!(
                    "train and test need at least one question each, got {} and {}",
                    sizes.train, sizes.test
                ),
            ));
        }
        let q = cfg.questions_per_entity;
        let (n_train, n_test) = (sizes.train.div_ceil(q), sizes.test.div_ceil(q));
        let total = n_train + n_test + cfg.distractors;
        let names_available = (CONSONANTS.len() * VOWELS.len()).pow(cfg.syllables as u32);
        if total > names_available / 4 {
            return Err(bad(
                "syllables",
                format!(
                    "{total} entities need more than a quarter of the {names_available} names of \
                     {} syllables; raise syllables or questions_per_entity",
                    cfg.syllables
                ),
            ));
        }
        let mut rng = TaskRng::new(seed);
        let reserved: HashSet<String> = SEARCH_TASK_ATTRIBUTES
            .iter()
            .flat_map(|(a, vs)| std::iter::once(*a).chain(vs.iter().copied()))
            .map(str::to_lowercase)
            .collect();
        let mut seen = HashSet::new();
        let mut entities = Vec::with_capacity(total);
        while entities.len() < total {
            let mut name = String::new();
            for _ in 0..cfg.syllables {
                name.push(char::from(*rng.pick(CONSONANTS)));
                name.push(char::from(*rng.pick(VOWELS)));
            }
            if reserved.contains(&name) || !seen.insert(name.clone()) {
                continue;
            }
            let mut chars = name.chars();
            let name: String = chars
                .next()
                .map(|c| c.to_ascii_uppercase())
                .into_iter()
                .chain(chars)
                .collect();
            let values = SEARCH_TASK_ATTRIBUTES
                .iter()
                .map(|(_, vs)| *rng.pick(vs))
                .collect();
            entities.push(Entity { name, values });
        }
        let questions = |range: std::ops::Range<usize>, n: usize, rng: &mut TaskRng| {
            let mut out = Vec::with_capacity(n);
            for e in &entities[range] {
                let mut attrs: Vec<usize> = (0..n_attr).collect();
                shuffle(&mut attrs, rng);
                for &a in attrs.iter().take(q) {
                    if out.len() < n {
                        out.push(SearchQuestion {
                            entity: e.name.clone(),
                            attribute: SEARCH_TASK_ATTRIBUTES[a].0,
                            answer: e.values[a],
                        });
                    }
                }
            }
            shuffle(&mut out, rng);
            out
        };
        let train = questions(0..n_train, sizes.train, &mut rng);
        let test = questions(n_train..n_train + n_test, sizes.test, &mut rng);
        Ok(SearchTask {
            entities,
            train,
            test,
        })
    }

    /// The corpus lines: one fact per entity and attribute,
    /// `{"id": "0", "contents": "\"Bako\"\nBako color is red."}`, entity by entity, ids
    /// counting from 0.
    pub fn corpus_lines(&self) -> Vec<String> {
        let mut lines = Vec::with_capacity(self.entities.len() * SEARCH_TASK_ATTRIBUTES.len());
        for e in &self.entities {
            for ((attr, _), value) in SEARCH_TASK_ATTRIBUTES.iter().zip(&e.values) {
                let contents = format!("\"{}\"\n{}", e.name, fact(&e.name, attr, value));
                // `id` first, as Search-R1's corpora are written
                let id = Value::from(lines.len().to_string());
                lines.push(format!(
                    "{{\"id\": {id}, \"contents\": {}}}",
                    Value::from(contents)
                ));
            }
        }
        lines
    }

    /// Writes [`SearchTask::corpus_lines`] to `path` (`corpus.jsonl`).
    pub fn write_corpus(&self, path: &Path) -> Result<()> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::io::BufWriter::new(File::create(path).map_err(io)?);
        for line in self.corpus_lines() {
            writeln!(f, "{line}").map_err(io)?;
        }
        f.flush().map_err(io)
    }

    /// Writes `train.parquet`, `test.parquet` and `sft.parquet` into `dir`. `search` must be
    /// the `search` tool RL will call (same index, same `topk`): each SFT trace carries its
    /// observation verbatim, and a trace whose observation is a failure or misses the answering
    /// fact is an error naming the query.
    pub fn write(&self, dir: &Path, search: &dyn Tool) -> Result<SearchTaskFiles> {
        if search.name() != "search" {
            return Err(Error::Config {
                key: "search_task.tool".into(),
                message: format!("expected the `search` tool, got `{}`", search.name()),
            });
        }
        let queries: Vec<String> = self.train.iter().map(SearchQuestion::query).collect();
        let observations = search.call(&queries);
        if observations.len() != queries.len() {
            return Err(Error::Config {
                key: "search_task.tool".into(),
                message: format!(
                    "{} observations for {} queries",
                    observations.len(),
                    queries.len()
                ),
            });
        }
        let mut traces = Vec::with_capacity(queries.len());
        for (q, obs) in self.train.iter().zip(&observations) {
            if !obs.valid || !obs.text.contains(&q.fact()) {
                return Err(Error::Config {
                    key: "search_task.tool".into(),
                    message: format!(
                        "the observation for query `{}` does not hold `{}` (is the index built \
                         from this task's corpus.jsonl?): {:?}",
                        q.query(),
                        q.fact(),
                        obs.text
                    ),
                });
            }
            traces.push(q.trace(&obs.text));
        }
        let train = dir.join("train.parquet");
        let test = dir.join("test.parquet");
        let sft = dir.join("sft.parquet");
        write_questions(&train, "train", &self.train, None)?;
        write_questions(&test, "test", &self.test, None)?;
        write_questions(&sft, "train", &self.train, Some(&traces))?;
        Ok(SearchTaskFiles { train, test, sft })
    }
}

/// Fisher–Yates with the task's random source.
fn shuffle<T>(items: &mut [T], rng: &mut TaskRng) {
    for i in (1..items.len()).rev() {
        let j = rng.index(i + 1);
        items.swap(i, j);
    }
}

fn write_questions(
    path: &Path,
    split: &str,
    questions: &[SearchQuestion],
    responses: Option<&[String]>,
) -> Result<()> {
    let records: Vec<RlRecord> = questions
        .iter()
        .enumerate()
        .map(|(index, q)| {
            let mut extra = Map::new();
            extra.insert("split".into(), split.into());
            extra.insert("index".into(), index.into());
            extra.insert("entity".into(), q.entity.clone().into());
            extra.insert("attribute".into(), q.attribute.into());
            extra.insert("query".into(), q.query().into());
            if let Some(r) = responses.and_then(|r| r.get(index)) {
                // where the harness's SFT reads a target (`sft.response_key`)
                extra.insert("response".into(), r.clone().into());
            }
            RlRecord {
                data_source: SEARCH_TASK_DATA_SOURCE.into(),
                prompt: vec![Message::user(q.prompt())],
                ability: "fact-reasoning".into(),
                style: "rule".into(),
                ground_truth: json!({ "target": [q.answer] }),
                extra_info: extra,
            }
        })
        .collect();
    let qa: Vec<(String, Vec<String>)> = questions
        .iter()
        .map(|q| (q.question(), vec![q.answer.to_string()]))
        .collect();
    write_qa_parquet(path, &records, &qa, responses)
}

/// Writes `records` as verl-schema parquet plus Search-R1's `question` and `golden_answers`
/// columns (and a `response` column when given), one `(question, golden_answers)` per record.
fn write_qa_parquet(
    path: &Path,
    records: &[RlRecord],
    qa: &[(String, Vec<String>)],
    responses: Option<&[String]>,
) -> Result<()> {
    write_rl_parquet(path, records)?;
    let question: ArrayRef = Arc::new(StringArray::from_iter_values(qa.iter().map(|(q, _)| q)));
    let mut golden = ListBuilder::new(StringBuilder::new());
    for (_, answers) in qa {
        for a in answers {
            golden.values().append_value(a);
        }
        golden.append(true);
    }
    let golden: ArrayRef = Arc::new(golden.finish());
    let mut extra = vec![("question", question), ("golden_answers", golden)];
    if let Some(r) = responses {
        extra.push(("response", Arc::new(StringArray::from_iter_values(r))));
    }
    let perr = |e: &dyn std::fmt::Display| Error::Parquet {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = File::open(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| perr(&e))?
        .build()
        .map_err(|e| perr(&e))?;
    let mut batches = Vec::new();
    let mut offset = 0;
    for b in reader {
        let b = b.map_err(|e| perr(&e))?;
        let n = b.num_rows();
        let mut fields: Vec<Field> = b
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        let mut columns = b.columns().to_vec();
        for (name, array) in &extra {
            fields.push(Field::new(*name, array.data_type().clone(), true));
            columns.push(array.slice(offset, n));
        }
        batches.push(
            RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).map_err(|e| perr(&e))?,
        );
        offset += n;
    }
    write_batches(path, &batches)
}

/// Search-R1's instruction (`nq_search.py`, template `base`) around a question; the question
/// is stripped and gets a `?` when it has none, as Search-R1's preprocessing does.
pub fn search_r1_prompt(question: &str) -> String {
    let mut q = question.trim().to_string();
    if !q.ends_with('?') {
        q.push('?');
    }
    format!(
        "Answer the given question. \
You must conduct reasoning inside <think> and </think> first every time you get new information. \
After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. \
You can search as many times as your want. \
If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: {q}\n"
    )
}

/// One QA line: FlashRAG's format, as Search-R1's data (`{"id", "question", "golden_answers"}`).
#[derive(Deserialize)]
struct QaLine {
    #[serde(default)]
    id: Option<Value>,
    question: String,
    golden_answers: Vec<String>,
}

/// Turns a QA JSON-lines file (`{"id": "...", "question": "...", "golden_answers": ["..."]}`
/// per line, FlashRAG's format that Search-R1 uses) into verl-schema parquet as Search-R1's
/// `nq_search.py` does: [`search_r1_prompt`] as the user message, `ground_truth = {"target":
/// golden_answers}`, `ability = "fact-reasoning"`, `extra_info = {split, index, id}` (`id` defaults
/// to `{split}_{index}`), and the `question` and `golden_answers` columns. `data_source` names the dataset (`nq`,
/// `hotpotqa`, ...; scored by exact match). Returns the row count; a bad line is an error
/// naming the file and line.
pub fn preprocess_search_r1_qa(
    input_jsonl: &Path,
    out: &Path,
    data_source: &str,
    split: &str,
) -> Result<usize> {
    let file = File::open(input_jsonl).map_err(|source| Error::Io {
        path: input_jsonl.to_path_buf(),
        source,
    })?;
    let mut records = Vec::new();
    let mut qa = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| Error::Io {
            path: input_jsonl.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| Error::Jsonl {
            path: input_jsonl.to_path_buf(),
            line: i + 1,
            message,
        };
        let row: QaLine = serde_json::from_str(&line).map_err(|e| {
            bad(format!(
                "expected {{\"question\": string, \"golden_answers\": [string]}}: {e}"
            ))
        })?;
        if row.question.trim().is_empty() {
            return Err(bad("`question` is empty".into()));
        }
        if row.golden_answers.is_empty() {
            return Err(bad("`golden_answers` is empty".into()));
        }
        let index = records.len();
        let mut extra = Map::new();
        extra.insert("split".into(), split.into());
        extra.insert("index".into(), index.into());
        let id = match row.id {
            Some(Value::String(s)) => s,
            Some(Value::Null) | None => format!("{split}_{index}"),
            Some(other) => other.to_string(),
        };
        extra.insert("id".into(), id.into());
        records.push(RlRecord {
            data_source: data_source.into(),
            prompt: vec![Message::user(search_r1_prompt(&row.question))],
            ability: "fact-reasoning".into(),
            style: "rule".into(),
            ground_truth: json!({ "target": row.golden_answers }),
            extra_info: extra,
        });
        qa.push((row.question.trim().to_string(), row.golden_answers));
    }
    if records.is_empty() {
        return Err(Error::EmptyFile {
            path: input_jsonl.to_path_buf(),
        });
    }
    write_qa_parquet(out, &records, &qa, None)?;
    Ok(records.len())
}

#[cfg(test)]
mod tests;
