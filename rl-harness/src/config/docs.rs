//! The meaning of each config key for docs/config.md, from the doc comments on the config
//! structs' fields: the sources are compiled in (`include_str!`) and read here, so the reference
//! cannot drift from the code. A key's struct is found by walking field types from
//! `ExperimentConfig` (`Option<T>`, `Merged<A, B>` and a struct's `#[serde(from = "...")]` taken
//! apart, `#[serde(rename = "...")]` obeyed).

use std::collections::BTreeMap;

/// Every source file that holds a config struct.
const SOURCES: &[&str] = &[
    include_str!("mod.rs"),
    include_str!("../bandit.rs"),
    include_str!("groups.rs"),
    include_str!("../../../rl-algos/src/config.rs"),
    include_str!("../../../rl-algos/src/dapo.rs"),
    include_str!("../../../rl-algos/src/dpo.rs"),
    include_str!("../../../rl-algos/src/loss.rs"),
    include_str!("../../../rl-algos/src/rollout_corr/config.rs"),
    include_str!("../../../rl-algos/src/trainer/config.rs"),
    include_str!("../../../rl-algos/src/trainer/preference.rs"),
    include_str!("../../../rl-algos/src/trainer/reward_model.rs"),
    include_str!("../../../rl-algos/src/trainer/sft.rs"),
    include_str!("../../../rl-data/src/config.rs"),
    include_str!("../../../rl-data/src/reward/mod.rs"),
    include_str!("../../../rl-workers/src/model.rs"),
    include_str!("../../../rl-workers/src/multiturn.rs"),
    include_str!("../../../rl-workers/src/rollout.rs"),
    include_str!("../../../rl-workers/src/roles/config.rs"),
    include_str!("../../../rl-workers/src/roles/reward_model.rs"),
    include_str!("../../../rl-tools/src/spec.rs"),
];

/// One field of a config struct: its serde name, type and the first sentence of its doc.
#[derive(Debug, Clone)]
struct Field {
    name: String,
    ty: String,
    doc: String,
}

/// A struct's fields, or the type it is read through (`#[serde(from = "...")]`).
#[derive(Debug, Clone, Default)]
struct Struct {
    fields: Vec<Field>,
    from: Option<String>,
}

/// Every `pub struct` of the sources with its documented fields.
fn structs() -> BTreeMap<String, Struct> {
    let mut out = BTreeMap::new();
    for src in SOURCES {
        let mut current: Option<(String, Struct)> = None;
        let mut doc: Vec<String> = Vec::new();
        let mut rename: Option<String> = None;
        let mut from: Option<String> = None;
        for line in src.lines() {
            let t = line.trim();
            if let Some((name, s)) = &mut current {
                if line.starts_with('}') {
                    out.insert(name.clone(), std::mem::take(s));
                    current = None;
                    continue;
                }
                if let Some(d) = t.strip_prefix("///") {
                    doc.push(d.trim().to_string());
                } else if t.starts_with("#[serde(") {
                    rename = quoted_after(t, "rename = ").or(rename.take());
                } else if let Some(rest) = ["pub ", "pub(crate) ", ""]
                    .iter()
                    .find_map(|p| t.strip_prefix(p))
                    .filter(|r| r.contains(':') && !r.starts_with("//"))
                {
                    if let Some((field, ty)) = rest.split_once(':') {
                        let field = field.trim();
                        if !field.contains(' ') && !field.contains('(') {
                            s.fields.push(Field {
                                name: rename.take().unwrap_or_else(|| field.to_string()),
                                ty: ty.trim().trim_end_matches(',').to_string(),
                                doc: first_sentence(&doc.join(" ")),
                            });
                        }
                    }
                    doc.clear();
                } else if !t.starts_with("//") && !t.starts_with("#[") {
                    doc.clear();
                }
                continue;
            }
            // `#[serde(from = "...")]`, on one line or spread over several
            if (t.starts_with("#[serde(") && t.contains("from = ")) || t.starts_with("from = ") {
                from = quoted_after(t, "from = ");
            }
            let declared = ["pub struct ", "pub(crate) struct ", "struct "]
                .iter()
                .find_map(|p| line.strip_prefix(p));
            if let Some(rest) = declared {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                // a newtype reads as the type it wraps
                if let Some(inner) = rest[name.len()..]
                    .strip_prefix("(pub ")
                    .and_then(|r| r.split_once(')'))
                    .map(|(t, _)| t.to_string())
                {
                    out.insert(
                        name,
                        Struct {
                            fields: Vec::new(),
                            from: Some(inner),
                        },
                    );
                    from = None;
                } else if rest.trim_end().ends_with('{') {
                    current = Some((
                        name,
                        Struct {
                            fields: Vec::new(),
                            from: from.take(),
                        },
                    ));
                    doc.clear();
                    rename = None;
                }
            } else if !t.starts_with("#[") && !t.starts_with("///") && !t.starts_with(')') {
                // an attribute list spread over lines keeps `from`; anything else ends it
                if !t.starts_with("into = ") && !t.starts_with("from = ") && !t.is_empty() {
                    from = None;
                }
            }
        }
    }
    out
}

/// The `"..."` after `key` in an attribute line.
fn quoted_after(line: &str, key: &str) -> Option<String> {
    let rest = &line[line.find(key)? + key.len()..];
    let rest = rest.strip_prefix('"')?;
    Some(rest[..rest.find('"')?].to_string())
}

/// Up to the first full stop followed by a space (not one of `e.g.`, `i.e.`), or the whole text.
fn first_sentence(doc: &str) -> String {
    let doc = doc.trim();
    let mut from = 0;
    while let Some(i) = doc[from..].find(". ").map(|i| i + from) {
        if !(doc[..i].ends_with("e.g") || doc[..i].ends_with("i.e")) {
            return doc[..=i].to_string();
        }
        from = i + 2;
    }
    doc.to_string()
}

/// The struct names a field type names: `Option<T>` -> T, `Merged<A, B>` -> A, B, a path's
/// last segment.
fn type_names(ty: &str) -> Vec<String> {
    let ty = ty.trim();
    for wrapper in ["Option<", "Box<"] {
        if let Some(inner) = ty.strip_prefix(wrapper).and_then(|r| r.strip_suffix('>')) {
            return type_names(inner);
        }
    }
    if let Some(inner) = ty.strip_prefix("Merged<").and_then(|r| r.strip_suffix('>')) {
        return split_generics(inner)
            .iter()
            .flat_map(|t| type_names(t))
            .collect();
    }
    let base = ty.split('<').next().unwrap_or(ty);
    vec![base.rsplit("::").next().unwrap_or(base).trim().to_string()]
}

/// `A, Merged<B, C>` -> [`A`, `Merged<B, C>`].
fn split_generics(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0);
    for ch in s.chars() {
        match ch {
            '<' => depth += 1,
            '>' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    out.push(cur);
    out
}

/// The documentation of every key the reference lists, by key path.
pub(super) struct KeyDocs {
    structs: BTreeMap<String, Struct>,
}

impl KeyDocs {
    /// Reads the sources.
    pub(super) fn load() -> KeyDocs {
        KeyDocs { structs: structs() }
    }

    /// The fields of struct `name`, through its `from` type.
    fn fields(&self, name: &str) -> Vec<&Field> {
        let Some(s) = self.structs.get(name) else {
            return Vec::new();
        };
        match &s.from {
            Some(from) => type_names(from)
                .iter()
                .flat_map(|t| self.fields(t))
                .collect(),
            None => s.fields.iter().collect(),
        }
    }

    /// The first sentence of `key`'s doc comment, if its field has one.
    pub(super) fn doc(&self, key: &str) -> Option<String> {
        let mut types = vec!["ExperimentConfig".to_string()];
        let mut doc = None;
        for seg in key.split('.') {
            let field = types
                .iter()
                .flat_map(|t| self.fields(t))
                .find(|f| f.name == seg)?;
            doc = Some(field.doc.clone()).filter(|d| !d.is_empty());
            types = type_names(&field.ty);
        }
        doc
    }
}
