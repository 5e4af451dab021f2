//! OmegaConf's interpolations in a YAML config, as Hydra saves a run's (`.hydra/config.yaml`
//! keeps them as written) and as verl's generated defaults hold them: `${a.b}` (a key of the
//! whole config), `${.b}` and `${..b}` (relative: a key beside the one that holds it, or one
//! level up per further dot), `${oc.select:a.b,default}` (the key, or the default where the
//! config lacks it), nested (`${oc.select:${.x},1}`) and inside text (`ckpt/${trainer.name}`).
//! Other resolvers (`oc.env`: the original run's environment, custom ones) are left as written
//! and reported.

use std::collections::BTreeMap;

use serde_json::Value;

/// Interpolations that refer to interpolations, at most this deep (a cycle ends here).
const MAX_DEPTH: usize = 32;

/// Resolves every interpolation of `doc` in place, against `doc` as given. Returns the keys
/// (dotted) whose value it left as written, each with why.
pub(super) fn resolve(doc: &mut Value) -> BTreeMap<String, String> {
    let root = doc.clone();
    let mut unresolved = BTreeMap::new();
    let mut path = Vec::new();
    resolve_tree(doc, &mut path, &root, 0, &mut unresolved);
    unresolved
}

/// Resolves the string leaves under `node`, which stands at `path` in `root`.
fn resolve_tree(
    node: &mut Value,
    path: &mut Vec<String>,
    root: &Value,
    depth: usize,
    unresolved: &mut BTreeMap<String, String>,
) {
    match node {
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                path.push(k.clone());
                resolve_tree(v, path, root, depth, unresolved);
                path.pop();
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter_mut().enumerate() {
                path.push(i.to_string());
                resolve_tree(v, path, root, depth, unresolved);
                path.pop();
            }
        }
        Value::String(s) if s.contains("${") => {
            let parent = &path[..path.len().saturating_sub(1)];
            match resolve_text(&s.clone(), parent, root, depth) {
                Ok(v) => *node = v,
                Err(why) => {
                    unresolved.insert(path.join("."), why);
                }
            }
        }
        _ => {}
    }
}

/// The value of `text`, held by a key of the node at `parent`: one interpolation alone is the
/// value it names (any type); interpolations inside text are replaced by their values' text.
fn resolve_text(
    text: &str,
    parent: &[String],
    root: &Value,
    depth: usize,
) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err("interpolations that refer to each other in a cycle".into());
    }
    let spans = spans(text)?;
    if let [(0, end)] = spans[..]
        && end == text.len()
    {
        return resolve_expr(&text[2..end - 1], parent, root, depth);
    }
    let mut out = String::new();
    let mut at = 0;
    for (start, end) in spans {
        out.push_str(&text[at..start]);
        match resolve_expr(&text[start + 2..end - 1], parent, root, depth)? {
            Value::String(s) => out.push_str(&s),
            // OmegaConf writes a null inside text as Python does
            Value::Null => out.push_str("None"),
            Value::Bool(b) => out.push_str(if b { "True" } else { "False" }),
            Value::Number(n) => out.push_str(&n.to_string()),
            _ => return Err(format!("`{text}` puts a table or a list inside text")),
        }
        at = end;
    }
    out.push_str(&text[at..]);
    Ok(Value::String(out))
}

/// The byte ranges of the top-level `${...}` of `text`, each from its `$` to past its `}`.
fn spans(text: &str) -> Result<Vec<(usize, usize)>, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 1 < bytes.len() {
        if bytes[i] == b'$' && bytes[i + 1] == b'{' {
            let start = i;
            let mut depth = 0usize;
            let mut j = i + 1;
            loop {
                match bytes.get(j) {
                    None => return Err(format!("`{text}` opens an interpolation it never closes")),
                    Some(b'{') => depth += 1,
                    Some(b'}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            out.push((start, j + 1));
            i = j + 1;
        } else {
            i += 1;
        }
    }
    Ok(out)
}

/// The value of one interpolation's inside (`a.b`, `.b`, `oc.select:a.b,1`).
fn resolve_expr(
    expr: &str,
    parent: &[String],
    root: &Value,
    depth: usize,
) -> Result<Value, String> {
    // a nested interpolation names the key: resolve it first
    let expr = if expr.contains("${") {
        match resolve_text(expr, parent, root, depth + 1)? {
            Value::String(s) => s,
            other => other.to_string(),
        }
    } else {
        expr.to_owned()
    };
    let expr = expr.trim();
    if let Some(args) = expr.strip_prefix("oc.select:") {
        let (key, default) = match super::verl::split_top_level(args).as_slice() {
            [key] => (key.trim().to_owned(), None),
            [key, default] => (key.trim().to_owned(), Some(default.trim().to_owned())),
            _ => return Err(format!("`oc.select:{args}` takes a key and a default")),
        };
        return match lookup(&key, parent, root) {
            Some((v, at)) => resolve_found(v, at, root, depth),
            None => match default {
                None => Ok(Value::Null),
                Some(d) if d.contains("${") => resolve_text(&d, parent, root, depth + 1),
                Some(d) => Ok(scalar(&d)),
            },
        };
    }
    if let Some((resolver, _)) = expr.split_once(':') {
        return Err(format!(
            "the resolver `{resolver}`, which this translation does not run"
        ));
    }
    match lookup(expr, parent, root) {
        Some((v, at)) => resolve_found(v, at, root, depth),
        None => Err(format!("`${{{expr}}}` names no key of the config")),
    }
}

/// A value an interpolation found at `at`, with its own interpolations resolved.
fn resolve_found(
    mut v: Value,
    mut at: Vec<String>,
    root: &Value,
    depth: usize,
) -> Result<Value, String> {
    if depth >= MAX_DEPTH {
        return Err("interpolations that refer to each other in a cycle".into());
    }
    let mut unresolved = BTreeMap::new();
    match &v {
        Value::String(s) if s.contains("${") => {
            at.pop();
            return resolve_text(&s.clone(), &at, root, depth + 1);
        }
        Value::Object(_) | Value::Array(_) => {
            resolve_tree(&mut v, &mut at, root, depth + 1, &mut unresolved)
        }
        _ => {}
    }
    match unresolved.into_iter().next() {
        Some((key, why)) => Err(format!("{key}: {why}")),
        None => Ok(v),
    }
}

/// The node `key` names (absolute, or relative to `parent` with leading dots) and its path.
fn lookup(key: &str, parent: &[String], root: &Value) -> Option<(Value, Vec<String>)> {
    let rest = key.trim_start_matches('.');
    let dots = key.len() - rest.len();
    let mut path: Vec<String> = if dots == 0 {
        Vec::new()
    } else {
        let up = dots - 1;
        parent.get(..parent.len().checked_sub(up)?)?.to_vec()
    };
    path.extend(rest.split('.').filter(|s| !s.is_empty()).map(str::to_owned));
    let mut node = root;
    for seg in &path {
        node = match node {
            Value::Object(map) => map.get(seg)?,
            Value::Array(items) => items.get(seg.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some((node.clone(), path))
}

/// A default as OmegaConf's grammar reads it: YAML's scalars (`1`, `0.5`, `true`, `null`,
/// quoted text), else the text itself.
fn scalar(text: &str) -> Value {
    serde_norway::from_str::<Value>(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn interpolations_resolve_as_omegaconf_does() {
        let mut doc: Value = serde_norway::from_str(
            "actor:\n  ppo_mini_batch_size: 16\n  ppo_epochs: 2\n  use_dynamic_bsz: false\n  \
             checkpoint:\n    save_contents: [model, optimizer]\n    load_contents: ${.save_contents}\n  \
             use_remove_padding: ${oc.select:model.use_remove_padding,false}\n  \
             rollout_n: ${oc.select:rollout.n,1}\n\
             model:\n  use_remove_padding: true\n  path: ~/models/x\n\
             critic:\n  ppo_mini_batch_size: ${oc.select:actor.ppo_mini_batch_size,null}\n  \
             ppo_epochs: ${actor.ppo_epochs}\n  dir: ckpt/${trainer.name}/step_${actor.ppo_epochs}\n  \
             strategy: ${..trainer.strategy}\n  nested: ${oc.select:${critic.which},7}\n  which: model.path\n  \
             chain: ${critic.ppo_epochs}\n  gone: ${oc.select:trainer.missing}\n\
             trainer:\n  name: run\n  strategy: fsdp\n  home: ${oc.env:HOME}\n  loop_a: ${trainer.loop_b}\n  \
             loop_b: ${trainer.loop_a}\n  missing_key: ${nowhere.at_all}\n",
        )
        .unwrap();
        let unresolved = resolve(&mut doc);
        assert_eq!(
            doc["actor"]["checkpoint"]["load_contents"],
            json!(["model", "optimizer"])
        );
        assert_eq!(doc["actor"]["use_remove_padding"], json!(true));
        assert_eq!(doc["actor"]["rollout_n"], json!(1));
        assert_eq!(doc["critic"]["ppo_mini_batch_size"], json!(16));
        assert_eq!(doc["critic"]["ppo_epochs"], json!(2));
        assert_eq!(doc["critic"]["dir"], json!("ckpt/run/step_2"));
        assert_eq!(doc["critic"]["strategy"], json!("fsdp"));
        assert_eq!(doc["critic"]["nested"], json!("~/models/x"));
        assert_eq!(doc["critic"]["chain"], json!(2));
        assert_eq!(doc["critic"]["gone"], json!(null));
        let keys: Vec<&str> = unresolved.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "trainer.home",
                "trainer.loop_a",
                "trainer.loop_b",
                "trainer.missing_key"
            ],
            "{unresolved:?}"
        );
        assert!(
            unresolved["trainer.home"].contains("`oc.env`"),
            "{unresolved:?}"
        );
        assert!(
            unresolved["trainer.loop_a"].contains("cycle"),
            "{unresolved:?}"
        );
        assert!(
            unresolved["trainer.missing_key"].contains("names no key"),
            "{unresolved:?}"
        );
        // left as written
        assert_eq!(doc["trainer"]["home"], json!("${oc.env:HOME}"));
    }
}
