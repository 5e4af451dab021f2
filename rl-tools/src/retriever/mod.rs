//! The BM25 retriever: a tantivy index of a Search-R1 corpus, searched in-process or served
//! over HTTP with Search-R1's retrieval protocol.
//!
//! The corpus is JSON lines, one passage per line: `{"id": "0", "contents": "\"Title\"\ntext"}`
//! (the title is the first line of `contents`, quoted as in Search-R1's wiki-18 corpus). The
//! whole of `contents` is indexed with tantivy's default tokenizer (lower-cased words) and
//! scored with BM25; a query is its words OR-ed together, so any text is a valid query.

mod server;

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tantivy::collector::TopDocs;
use tantivy::query::BooleanQuery;
use tantivy::schema::{FAST, Field, STORED, STRING, Schema, TEXT, Value as _};
use tantivy::tokenizer::TextAnalyzer;
use tantivy::{
    Index, IndexReader, IndexSettings, IndexSortByField, IndexWriter, Order, ReloadPolicy,
    TantivyDocument, Term,
};

pub use server::{ServeOptions, ServerHandle, serve, serve_in_background, start_server};

use crate::error::{Error, Result};

/// The largest `topk` a search may ask for.
pub const MAX_TOPK: usize = 1000;

/// One corpus passage, as stored and as returned (Search-R1's `document`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Doc {
    /// The corpus `id`.
    pub id: String,
    /// `"Title"\ntext`.
    pub contents: String,
}

impl Doc {
    /// The title: the first line of `contents` (with its quotes, as Search-R1 shows it).
    pub fn title(&self) -> &str {
        self.contents.split('\n').next().unwrap_or("")
    }

    /// The text: every line after the first.
    pub fn text(&self) -> &str {
        self.contents.split_once('\n').map_or("", |(_, t)| t)
    }
}

/// What [`build_index`] indexed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexStats {
    /// Passages indexed.
    pub docs: u64,
}

/// A corpus line; unknown keys (Search-R1 corpora sometimes carry more) are ignored.
#[derive(Deserialize)]
struct CorpusLine {
    id: serde_json::Value,
    contents: String,
}

/// The fast field holding each passage's position in the corpus: the index is sorted by it and
/// merged into one segment, so tantivy's tie-break (the lower document id) is corpus order.
const ORD_FIELD: &str = "ord";

fn schema() -> (Schema, Field, Field, Field) {
    let mut b = Schema::builder();
    let id = b.add_text_field("id", STRING | STORED);
    let contents = b.add_text_field("contents", TEXT | STORED);
    let ord = b.add_u64_field(ORD_FIELD, FAST);
    (b.build(), id, contents, ord)
}

fn index_err(path: &Path) -> impl Fn(tantivy::TantivyError) -> Error + '_ {
    move |e| Error::Index {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// Builds a BM25 index of `corpus_jsonl` in `index_dir` (created; it must be empty or absent).
///
/// Each non-blank line must be `{"id": string | number, "contents": string}`; a bad line is an
/// error naming the file and its line number, and the folder is left as it was found (removed
/// when this call created it, emptied otherwise). The index is sorted by corpus position and
/// merged into one segment, so equal scores rank in corpus order.
pub fn build_index(corpus_jsonl: &Path, index_dir: &Path) -> Result<IndexStats> {
    build_index_committing(corpus_jsonl, index_dir, None)
}

/// [`build_index`], committing every `commit_every` passages when given (each commit starts a
/// segment: the tests' way to a many-segment index without a corpus of hundreds of MB).
fn build_index_committing(
    corpus_jsonl: &Path,
    index_dir: &Path,
    commit_every: Option<u64>,
) -> Result<IndexStats> {
    let file = File::open(corpus_jsonl).map_err(|source| Error::Io {
        path: corpus_jsonl.to_path_buf(),
        source,
    })?;
    let io = |source| Error::Io {
        path: index_dir.to_path_buf(),
        source,
    };
    let existed = index_dir.exists();
    if existed && std::fs::read_dir(index_dir).map_err(io)?.next().is_some() {
        return Err(Error::Index {
            path: index_dir.to_path_buf(),
            message: "the folder is not empty; give a new or empty folder".into(),
        });
    }
    std::fs::create_dir_all(index_dir).map_err(io)?;
    let built = write_index(file, corpus_jsonl, index_dir, commit_every);
    if built.is_err() {
        // leave the folder as it was found
        if existed {
            if let Ok(entries) = std::fs::read_dir(index_dir) {
                for e in entries.flatten() {
                    let p = e.path();
                    let _ = if p.is_dir() {
                        std::fs::remove_dir_all(&p)
                    } else {
                        std::fs::remove_file(&p)
                    };
                }
            }
        } else {
            let _ = std::fs::remove_dir_all(index_dir);
        }
    }
    built
}

fn write_index(
    file: File,
    corpus_jsonl: &Path,
    index_dir: &Path,
    commit_every: Option<u64>,
) -> Result<IndexStats> {
    let (schema, id_f, contents_f, ord_f) = schema();
    let settings = IndexSettings {
        sort_by_field: Some(IndexSortByField {
            field: ORD_FIELD.into(),
            order: Order::Asc,
        }),
        ..IndexSettings::default()
    };
    let index = Index::builder()
        .schema(schema)
        .settings(settings)
        .create_in_dir(index_dir)
        .map_err(index_err(index_dir))?;
    let mut writer: IndexWriter = index
        .writer_with_num_threads(1, 100_000_000)
        .map_err(index_err(index_dir))?;
    let bad = |line: usize, message: String| Error::CorpusLine {
        path: corpus_jsonl.to_path_buf(),
        line,
        message,
    };
    let mut docs = 0u64;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| Error::Io {
            path: corpus_jsonl.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let row: CorpusLine = serde_json::from_str(&line).map_err(|e| {
            bad(
                i + 1,
                format!("expected {{\"id\": ..., \"contents\": \"...\"}}: {e}"),
            )
        })?;
        let id = match row.id {
            serde_json::Value::String(s) => s,
            serde_json::Value::Number(n) => n.to_string(),
            other => return Err(bad(i + 1, format!("`id` must be a string, got {other}"))),
        };
        let mut doc = TantivyDocument::default();
        doc.add_text(id_f, &id);
        doc.add_text(contents_f, &row.contents);
        doc.add_u64(ord_f, docs);
        writer.add_document(doc).map_err(index_err(index_dir))?;
        docs += 1;
        if commit_every.is_some_and(|n| docs.is_multiple_of(n)) {
            writer.commit().map_err(index_err(index_dir))?;
        }
    }
    if docs == 0 {
        return Err(Error::CorpusLine {
            path: corpus_jsonl.to_path_buf(),
            line: 0,
            message: "the corpus has no passages".into(),
        });
    }
    writer.commit().map_err(index_err(index_dir))?;
    // one segment: the searcher orders segments by hash, so ties across segments would not
    // follow the corpus; the sorted merge lays the documents out in `ord` order
    let segments = index
        .searchable_segment_ids()
        .map_err(index_err(index_dir))?;
    if segments.len() > 1 {
        writer
            .merge(&segments)
            .wait()
            .map_err(index_err(index_dir))?;
    }
    writer
        .wait_merging_threads()
        .map_err(index_err(index_dir))?;
    Ok(IndexStats { docs })
}

/// An opened index: BM25 search over the corpus, safe to share between threads.
#[derive(Clone)]
pub struct Retriever {
    dir: PathBuf,
    reader: IndexReader,
    analyzer: TextAnalyzer,
    id: Field,
    contents: Field,
    docs: u64,
}

impl std::fmt::Debug for Retriever {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retriever")
            .field("dir", &self.dir)
            .field("docs", &self.docs)
            .finish()
    }
}

impl Retriever {
    /// Opens an index made by [`build_index`].
    pub fn open(dir: &Path) -> Result<Retriever> {
        if !dir.join("meta.json").is_file() {
            return Err(Error::Index {
                path: dir.to_path_buf(),
                message:
                    "no index here (meta.json is missing); build one with `harness retriever index`"
                        .into(),
            });
        }
        let index = Index::open_in_dir(dir).map_err(index_err(dir))?;
        let schema = index.schema();
        let field = |name: &str| {
            schema.get_field(name).map_err(|_| Error::Index {
                path: dir.to_path_buf(),
                message: format!(
                    "the index has no `{name}` field; it was not built by build_index"
                ),
            })
        };
        let (id, contents) = (field("id")?, field("contents")?);
        if schema.get_field(ORD_FIELD).is_err() {
            return Err(Error::Index {
                path: dir.to_path_buf(),
                message: format!(
                    "the index has no `{ORD_FIELD}` field (built by an older harness); rebuild \
                     it with `harness retriever index`"
                ),
            });
        }
        let analyzer = index
            .tokenizer_for_field(contents)
            .map_err(index_err(dir))?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(index_err(dir))?;
        let docs = reader.searcher().num_docs();
        Ok(Retriever {
            dir: dir.to_path_buf(),
            reader,
            analyzer,
            id,
            contents,
            docs,
        })
    }

    /// Passages in the index.
    pub fn num_docs(&self) -> u64 {
        self.docs
    }

    /// The index folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The `topk` best passages of each query with their BM25 scores, best first, in query
    /// order. A query with no indexed word gets no passages. `topk` must be in
    /// `1..=`[`MAX_TOPK`].
    pub fn search(&self, queries: &[String], topk: usize) -> Result<Vec<Vec<(Doc, f32)>>> {
        if !(1..=MAX_TOPK).contains(&topk) {
            return Err(Error::Config {
                key: "topk".into(),
                message: format!("must be in 1..={MAX_TOPK}, got {topk}"),
            });
        }
        let searcher = self.reader.searcher();
        let err = index_err(&self.dir);
        let mut out = Vec::with_capacity(queries.len());
        for q in queries {
            let mut terms = Vec::new();
            let mut analyzer = self.analyzer.clone();
            let mut stream = analyzer.token_stream(q);
            while let Some(tok) = stream.next() {
                terms.push(Term::from_field_text(self.contents, &tok.text));
            }
            if terms.is_empty() {
                out.push(Vec::new());
                continue;
            }
            let query = BooleanQuery::new_multiterms_query(terms);
            // best score first; equal scores by document id, which is corpus order
            let hits = searcher
                .search(&query, &TopDocs::with_limit(topk).order_by_score())
                .map_err(&err)?;
            let mut docs = Vec::with_capacity(hits.len());
            for (score, addr) in hits {
                let d: TantivyDocument = searcher.doc(addr).map_err(&err)?;
                let text = |f: Field| {
                    d.get_first(f)
                        .and_then(|v| v.as_str())
                        .unwrap_or_default()
                        .to_string()
                };
                docs.push((
                    Doc {
                        id: text(self.id),
                        contents: text(self.contents),
                    },
                    score,
                ));
            }
            out.push(docs);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
