//! "Did you mean ...": the known name nearest to a mistyped one, for the errors of the config
//! (keys), the store (metric names) and the CLI (projects, sort keys). A leaf: it uses nothing
//! else in the crate.

/// The known key nearest to `key` by edit distance, if it is plausibly a typo.
pub fn nearest_key(key: &str, known: &[String]) -> Option<String> {
    let parent = key.rsplit_once('.').map(|(p, _)| p).unwrap_or("");
    known
        .iter()
        .map(|k| {
            // Prefer siblings: a key in the same group costs less than one elsewhere.
            let kp = k.rsplit_once('.').map(|(p, _)| p).unwrap_or("");
            let penalty = usize::from(kp != parent);
            (levenshtein(key, k) + penalty, k)
        })
        .min()
        .filter(|(d, _)| *d <= key.len().max(4) / 2 + 1)
        .map(|(_, k)| k.clone())
}

/// Levenshtein edit distance over chars.
pub fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levenshtein_basics() {
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("", "abc"), 3);
        assert_eq!(levenshtein("same", "same"), 0);
    }
}
