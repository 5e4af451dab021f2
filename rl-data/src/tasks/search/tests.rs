//! The synthetic search task and the Search-R1 QA preprocessor.

use std::collections::HashSet;

use rl_core::Observation;

use super::*;
use crate::reward::RewardRegistry;
use crate::{ReadOptions, RlDataset, SftDataConfig, SftDataset};

/// A stand-in for rl-tools' search tool over the task's corpus: the passages of the queried
/// entity, the one naming the queried attribute first, formatted as Search-R1 formats them.
#[derive(Debug)]
struct FakeSearch {
    docs: Vec<(String, String)>,
}

impl FakeSearch {
    fn new(task: &SearchTask) -> Self {
        let docs = task
            .corpus_lines()
            .iter()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                let c = v["contents"].as_str().unwrap();
                let (t, text) = c.split_once('\n').unwrap();
                (t.to_string(), text.to_string())
            })
            .collect();
        FakeSearch { docs }
    }
}

impl Tool for FakeSearch {
    fn name(&self) -> &str {
        "search"
    }
    fn call(&self, arguments: &[String]) -> Vec<Observation> {
        arguments
            .iter()
            .map(|q| {
                let (name, attr) = q.split_once(' ').unwrap();
                let mut hits: Vec<&(String, String)> = self
                    .docs
                    .iter()
                    .filter(|(t, _)| *t == format!("\"{name}\""))
                    .collect();
                hits.sort_by_key(|(_, text)| !text.contains(attr));
                let passages: String = hits
                    .iter()
                    .enumerate()
                    .map(|(i, (t, text))| format!("Doc {}(Title: {t}) {text}\n", i + 1))
                    .collect();
                Observation::ok(format!(
                    "\n\n<information>{}</information>\n\n",
                    passages.trim()
                ))
            })
            .collect()
    }
}

fn sizes(train: usize, test: usize) -> SplitSizes {
    SplitSizes { train, test }
}

fn write_task(dir: &Path, seed: u64) -> (SearchTask, SearchTaskFiles) {
    let task = SearchTask::generate(&SearchTaskConfig::default(), sizes(20, 7), seed).unwrap();
    task.write_corpus(&dir.join("corpus.jsonl")).unwrap();
    let files = task.write(dir, &FakeSearch::new(&task)).unwrap();
    (task, files)
}

#[test]
fn the_same_seed_gives_byte_identical_files_and_another_seed_does_not() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_task(a.path(), 7);
    write_task(b.path(), 7);
    write_task(c.path(), 8);
    for f in [
        "corpus.jsonl",
        "train.parquet",
        "test.parquet",
        "sft.parquet",
    ] {
        let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(f)).unwrap();
        assert_eq!(read(&a), read(&b), "{f}");
        assert_ne!(read(&a), read(&c), "{f}");
    }
}

#[test]
fn train_and_test_ask_about_disjoint_entities_and_the_corpus_answers_every_question() {
    let task = SearchTask::generate(&SearchTaskConfig::default(), sizes(200, 50), 3).unwrap();
    assert_eq!((task.train.len(), task.test.len()), (200, 50));
    let train: HashSet<&str> = task.train.iter().map(|q| q.entity.as_str()).collect();
    let test: HashSet<&str> = task.test.iter().map(|q| q.entity.as_str()).collect();
    assert!(train.is_disjoint(&test));
    // 3 questions per entity, each about a different attribute
    assert_eq!(train.len(), 67);
    let asked: HashSet<(&str, &str)> = task
        .train
        .iter()
        .map(|q| (q.entity.as_str(), q.attribute))
        .collect();
    assert_eq!(asked.len(), 200);
    let corpus = task.corpus_lines();
    assert_eq!(corpus.len(), (67 + 17) * 3);
    assert!(
        corpus[0].starts_with("{\"id\": \"0\", \"contents\": \""),
        "{}",
        corpus[0]
    );
    assert!(serde_json::from_str::<Value>(&corpus[1]).is_ok());
    for q in task.train.iter().chain(&task.test) {
        let contents = format!("\"{}\"\n{}", q.entity, q.fact());
        let needle = format!("\"contents\": {}}}", Value::from(contents));
        assert_eq!(
            corpus.iter().filter(|l| l.ends_with(&needle)).count(),
            1,
            "{}",
            q.fact()
        );
    }
    // answers are spread over the 8 values (guessing is right about 1 time in 8)
    let colors: HashSet<&str> = task
        .train
        .iter()
        .filter(|q| q.attribute == "color")
        .map(|q| q.answer)
        .collect();
    assert!(colors.len() >= 6, "{colors:?}");
    let distractors = SearchTaskConfig {
        distractors: 5,
        questions_per_entity: 1,
        ..Default::default()
    };
    let t = SearchTask::generate(&distractors, sizes(4, 2), 3).unwrap();
    assert_eq!(t.corpus_lines().len(), (4 + 2 + 5) * 3);
}

#[test]
fn rows_have_search_r1_shape_and_sft_traces_carry_the_tool_observation() {
    let dir = tempfile::tempdir().unwrap();
    let (task, files) = write_task(dir.path(), 1);
    let opts = ReadOptions {
        prompt_key: "prompt".into(),
        reward_fn_key: "data_source".into(),
        max_samples: None,
    };
    let ds = RlDataset::open(std::slice::from_ref(&files.train), &opts).unwrap();
    assert_eq!(ds.len(), 20);
    let row = ds.row(0).unwrap();
    let q = &task.train[0];
    assert_eq!(row.data_source, SEARCH_TASK_DATA_SOURCE);
    assert_eq!(row.prompt, vec![Message::user(q.prompt())]);
    assert_eq!(
        q.prompt(),
        format!(
            "What is the {} of {}?\nUse <search>, then <answer>.",
            q.attribute, q.entity
        )
    );
    assert_eq!(row.ground_truth, json!({"target": [q.answer]}));
    assert_eq!(row.extra_info["query"], json!(q.query()));
    assert_eq!(row.extra_info["split"], json!("train"));

    let sft = SftDataset::open(
        std::slice::from_ref(&files.sft),
        &SftDataConfig {
            prompt_key: "prompt".into(),
            response_key: "response".into(),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(sft.len(), 20);
    let msgs = sft.messages(0).unwrap();
    let obs = &FakeSearch::new(&task).call(&[q.query()])[0].text;
    let trace = format!(
        "<search>{}</search>{obs}<answer>{}</answer>",
        q.query(),
        q.answer
    );
    assert_eq!(
        msgs,
        vec![Message::user(q.prompt()), Message::assistant(&trace)]
    );
    assert!(trace.contains(&format!(
        "\n\n<information>Doc 1(Title: \"{}\") {}\n",
        q.entity,
        q.fact()
    )));
    // the trace earns the full reward, a guess without the tag earns none
    let r = RewardRegistry::verl_default();
    assert_eq!(
        r.score(&row.data_source, &trace, &row.ground_truth, &Value::Null)
            .unwrap()
            .score,
        1.0
    );

    // Search-R1's extra columns
    let (_, reader) =
        crate::parquet_io::read_columns(&files.test, &["question", "golden_answers"]).unwrap();
    let b = reader.into_iter().next().unwrap().unwrap();
    let questions = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
    assert_eq!(questions.value(0), task.test[0].question());
    let golden = b
        .column(1)
        .as_any()
        .downcast_ref::<arrow::array::ListArray>()
        .unwrap();
    let first = golden.value(0);
    let first = first.as_any().downcast_ref::<StringArray>().unwrap();
    assert_eq!(first.value(0), task.test[0].answer);
}

#[test]
fn a_tool_that_misses_the_fact_or_is_not_search_is_an_error_naming_the_query() {
    #[derive(Debug)]
    struct Wrong(&'static str);
    impl Tool for Wrong {
        fn name(&self) -> &str {
            self.0
        }
        fn call(&self, arguments: &[String]) -> Vec<Observation> {
            arguments
                .iter()
                .map(|_| {
                    Observation::ok("\n\n<information>Doc 1(Title: \"X\") x</information>\n\n")
                })
                .collect()
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let task = SearchTask::generate(&SearchTaskConfig::default(), sizes(3, 1), 0).unwrap();
    let e = task
        .write(dir.path(), &Wrong("search"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("query `{}`", task.train[0].query())) && e.contains("corpus.jsonl"),
        "{e}"
    );
    let e = task
        .write(dir.path(), &Wrong("calculator"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`calculator`"), "{e}");
}

#[test]
fn bad_options_are_errors_naming_the_key() {
    let gen_err = |cfg: SearchTaskConfig, s: SplitSizes| {
        SearchTask::generate(&cfg, s, 0).unwrap_err().to_string()
    };
    let d = SearchTaskConfig::default();
    let e = gen_err(
        SearchTaskConfig {
            questions_per_entity: 4,
            ..d
        },
        sizes(1, 1),
    );
    assert!(e.contains("search_task.questions_per_entity"), "{e}");
    let e = gen_err(SearchTaskConfig { syllables: 1, ..d }, sizes(1, 1));
    assert!(e.contains("search_task.syllables"), "{e}");
    let e = gen_err(d, sizes(5000, 10));
    assert!(
        e.contains("search_task.syllables") && e.contains("raise"),
        "{e}"
    );
    let e = gen_err(d, sizes(10, 0));
    assert!(e.contains("search_task.sizes"), "{e}");
}

#[test]
fn the_search_r1_prompt_is_nq_search_py_s_base_template() {
    assert_eq!(
        search_r1_prompt(" who wrote hamlet "),
        "Answer the given question. You must conduct reasoning inside <think> and </think> first \
         every time you get new information. After reasoning, if you find you lack some \
         knowledge, you can call a search engine by <search> query </search> and it will return \
         the top searched results between <information> and </information>. You can search as \
         many times as your want. If you find no further external knowledge needed, you can \
         directly provide the answer inside <answer> and </answer>, without detailed \
         illustrations. For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n"
    );
    assert!(search_r1_prompt("Is it?").ends_with("Question: Is it?\n"));
}

#[test]
fn qa_jsonl_becomes_search_r1_parquet_and_a_bad_line_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("nq.jsonl");
    std::fs::write(
        &input,
        "{\"id\": \"q1\", \"question\": \"capital of norway\", \"golden_answers\": [\"Oslo\"]}\n\n\
         {\"question\": \"who wrote hamlet?\", \"golden_answers\": [\"Shakespeare\", \"W. Shakespeare\"]}\n",
    )
    .unwrap();
    let out = dir.path().join("train.parquet");
    assert_eq!(
        preprocess_search_r1_qa(&input, &out, "nq", "train").unwrap(),
        2
    );
    let opts = ReadOptions {
        prompt_key: "prompt".into(),
        reward_fn_key: "data_source".into(),
        max_samples: None,
    };
    let ds = RlDataset::open(std::slice::from_ref(&out), &opts).unwrap();
    let row = ds.row(1).unwrap();
    assert_eq!(row.data_source, "nq");
    assert_eq!(
        row.prompt,
        vec![Message::user(search_r1_prompt("who wrote hamlet?"))]
    );
    assert_eq!(
        row.ground_truth,
        json!({"target": ["Shakespeare", "W. Shakespeare"]})
    );
    assert_eq!(row.extra_info["id"], json!("train_1"));
    assert_eq!(ds.row(0).unwrap().extra_info["id"], json!("q1"));

    std::fs::write(&input, "{\"question\": \"x\", \"golden_answers\": []}\n").unwrap();
    let e = preprocess_search_r1_qa(&input, &out, "nq", "train")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nq.jsonl") && e.contains("line 1") && e.contains("golden_answers"),
        "{e}"
    );
    std::fs::write(&input, "\n{\"question\": 3}\n").unwrap();
    let e = preprocess_search_r1_qa(&input, &out, "nq", "train")
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 2"), "{e}");
}

#[test]
fn prompts_and_traces_fit_the_tiny_character_level_tokenizer() {
    let vocab: HashSet<String> = crate::tasks::tiny_vocab::tiny_vocab().into_iter().collect();
    let task = SearchTask::generate(&SearchTaskConfig::default(), sizes(300, 30), 9).unwrap();
    let tool = FakeSearch::new(&task);
    let mut longest = (0, 0);
    for q in &task.train {
        let obs = &tool.call(&[q.query()])[0].text;
        let (prompt, trace) = (q.prompt(), q.trace(obs));
        for c in prompt.chars().chain(trace.chars()) {
            assert!(vocab.contains(&c.to_string()), "{c:?} in {trace:?}");
        }
        longest = (
            longest.0.max(prompt.chars().count()),
            longest.1.max(trace.chars().count()),
        );
    }
    // one token per character: short enough for a tiny model's context
    assert!(longest.0 <= 64 && longest.1 <= 256, "{longest:?}");
}
