//! Index building and search over a small corpus.

use super::*;

fn corpus(dir: &Path, lines: &[&str]) -> PathBuf {
    let p = dir.join("corpus.jsonl");
    std::fs::write(&p, lines.join("\n")).unwrap();
    p
}

const LINES: [&str; 4] = [
    r#"{"id": "0", "contents": "\"Paris\"\nParis is the capital of France."}"#,
    r#"{"id": "1", "contents": "\"Berlin\"\nBerlin is the capital of Germany."}"#,
    r#"{"id": 2, "contents": "\"Rhine\"\nThe Rhine flows through Germany and France.", "extra": 1}"#,
    r#"{"id": "3", "contents": "\"Zorbu\"\nZorbu color is teal."}"#,
];

#[test]
fn the_index_finds_the_matching_passage_first_in_query_order() {
    let tmp = tempfile::tempdir().unwrap();
    let c = corpus(tmp.path(), &LINES);
    let idx = tmp.path().join("idx");
    assert_eq!(build_index(&c, &idx).unwrap(), IndexStats { docs: 4 });
    let r = Retriever::open(&idx).unwrap();
    assert_eq!(r.num_docs(), 4);
    let out = r
        .search(
            &[
                "capital of Germany".into(),
                "zorbu COLOR?".into(),
                "(((".into(),
                "nothing matches xyzzy".into(),
            ],
            2,
        )
        .unwrap();
    assert_eq!(out.len(), 4);
    assert_eq!(out[0][0].0.id, "1");
    assert_eq!(out[0].len(), 2);
    assert!(out[0][0].1 > out[0][1].1);
    assert_eq!(out[1][0].0.id, "3");
    assert_eq!(out[1][0].0.title(), "\"Zorbu\"");
    assert_eq!(out[1][0].0.text(), "Zorbu color is teal.");
    assert!(out[2].is_empty() && out[3].is_empty());
    let e = r.search(&["x".into()], 0).unwrap_err().to_string();
    assert!(e.starts_with("topk"), "{e}");
}

/// Equal scores rank in corpus order even when the passages were written into many segments
/// (whose order in tantivy's searcher, and in a plain merge, is that of a hash map): the index
/// is sorted by corpus position and merged into one segment.
#[test]
fn equal_scores_rank_in_corpus_order_across_segments() {
    let tmp = tempfile::tempdir().unwrap();
    // twelve passages that score the same for `alpha` (same length, one unique word each)
    let lines: Vec<String> = (0..12)
        .map(|i| format!(r#"{{"id": "{i}", "contents": "\"P{i:02}\"\nalpha"}}"#))
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let c = corpus(tmp.path(), &lines);
    let idx = tmp.path().join("idx");
    build_index_committing(&c, &idx, Some(2)).unwrap();
    let r = Retriever::open(&idx).unwrap();
    assert_eq!(r.reader.searcher().segment_readers().len(), 1);
    for topk in [12, 3] {
        let out = r.search(&["alpha".into()], topk).unwrap();
        let ids: Vec<&str> = out[0].iter().map(|(d, _)| d.id.as_str()).collect();
        let want: Vec<String> = (0..topk).map(|i| i.to_string()).collect();
        assert_eq!(ids, want, "topk {topk}");
        assert!(out[0].iter().all(|(_, s)| *s == out[0][0].1), "{out:?}");
    }
}

#[test]
fn a_bad_corpus_line_names_the_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let c = corpus(tmp.path(), &[LINES[0], "", r#"{"id": "2"}"#]);
    let e = build_index(&c, &tmp.path().join("idx"))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with(&format!("{}:3: ", c.display())), "{e}");
    assert!(e.contains("contents"), "{e}");
    // nothing is left behind: the same folder takes a good corpus next
    assert!(!tmp.path().join("idx").exists());
    let good = corpus(tmp.path(), &LINES);
    std::fs::create_dir(tmp.path().join("empty")).unwrap();
    std::fs::write(tmp.path().join("bad.jsonl"), "not json\n").unwrap();
    let e = build_index(&tmp.path().join("bad.jsonl"), &tmp.path().join("empty")).unwrap_err();
    assert!(e.to_string().contains("bad.jsonl:1:"), "{e}");
    assert_eq!(
        std::fs::read_dir(tmp.path().join("empty")).unwrap().count(),
        0
    );
    assert_eq!(
        build_index(&good, &tmp.path().join("empty")).unwrap().docs,
        4
    );
    let c = corpus(tmp.path(), &[r#"{"id": [1], "contents": "x"}"#]);
    let e = build_index(&c, &tmp.path().join("idx2"))
        .unwrap_err()
        .to_string();
    assert!(e.contains(":1: `id` must be a string"), "{e}");
    let e = build_index(&tmp.path().join("missing.jsonl"), &tmp.path().join("idx3"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.jsonl"), "{e}");
}

#[test]
fn an_index_is_not_built_over_a_non_empty_folder_and_opening_a_non_index_fails() {
    let tmp = tempfile::tempdir().unwrap();
    let c = corpus(tmp.path(), &LINES);
    let e = build_index(&c, tmp.path()).unwrap_err().to_string();
    assert!(e.contains("not empty"), "{e}");
    let e = Retriever::open(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("meta.json is missing"), "{e}");
}
