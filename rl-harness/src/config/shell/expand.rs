//! A word as bash expands it: quotes removed, `$name`, `${name...}` (defaults, alternatives,
//! lengths, prefix and suffix trimming, literal replacement, case, substrings, array elements),
//! `$((...))` arithmetic, `$(pwd)`, tilde, and word splitting of unquoted expansions. What this
//! cannot know (another command's output, a variable the script sets inside a branch not
//! followed here, one set neither by the script nor in the environment) is an `Err` saying why.

use std::collections::HashMap;

use super::lex::is_name;

/// A variable of the script.
#[derive(Debug, Clone)]
pub(super) enum Var {
    Str(String),
    Array(Vec<String>),
    /// Its value is not known here, for this reason.
    Unknown(String),
}

/// Where a variable the script reads comes from, beside the script itself.
pub struct Env<'a> {
    /// The environment `harness` runs in (`$HOME`, or what a user sets for the conversion).
    pub var: &'a dyn Fn(&str) -> Option<String>,
    /// The directory `harness` runs in: `$(pwd)`.
    pub cwd: Option<String>,
    /// The script's arguments: `$1`, `$2`, ..., `"$@"`.
    pub args: &'a [String],
}

/// A script's variables while it is read.
pub(super) struct Shell<'a> {
    pub(super) vars: HashMap<String, Var>,
    env: Env<'a>,
    /// Why a variable the script does not set may still be set (`source FILE`, `eval`).
    pub(super) opaque: Option<String>,
    /// Why `$(pwd)` is not the directory harness runs in (a `cd`).
    pub(super) moved: Option<String>,
    /// An unset variable reads as empty (in a test, as `[ -z "$X" ]` means it), not as an error.
    pub(super) unset_is_empty: bool,
    /// Why the command being read may not run (`${x:=v}` then sets `x` to an unknown value).
    pub(super) maybe: Option<String>,
    /// The script's arguments, as `shift` leaves them.
    pub(super) args: Vec<String>,
    /// Why the arguments are not known any more (`shift` in a branch, `set --`).
    pub(super) args_unknown: Option<String>,
}

/// An expansion's value: one string, a list (`"$@"`, `"${a[@]}"`), or fields already split
/// (an unquoted `${x:-word}`'s word, split where its own quotes allow).
enum Val {
    Str(String),
    List(Vec<String>),
    Fields(Vec<String>),
}

/// What a name holds.
enum Lookup {
    Set(Val),
    Unset,
    Unknown(String),
}

/// The fields a word expands to.
#[derive(Default)]
struct Fields {
    done: Vec<String>,
    cur: String,
    started: bool,
}

impl Fields {
    fn lit(&mut self, s: &str) {
        self.cur.push_str(s);
        self.started = true;
    }

    /// An unquoted expansion's value: split at blanks.
    fn split(&mut self, v: &str) {
        if v.starts_with(char::is_whitespace) && self.started {
            self.end();
        }
        let mut parts = v.split_whitespace();
        if let Some(first) = parts.next() {
            self.lit(first);
            for p in parts {
                self.end();
                self.lit(p);
            }
            if v.ends_with(char::is_whitespace) {
                self.end();
            }
        }
    }

    /// A quoted list: each element its own field.
    fn list(&mut self, items: &[String]) {
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                self.end();
            }
            self.lit(item);
        }
    }

    fn end(&mut self) {
        if self.started {
            self.done.push(std::mem::take(&mut self.cur));
            self.started = false;
        }
    }

    fn finish(mut self) -> Vec<String> {
        self.end();
        self.done
    }
}

/// The index of the character closing the bracket opened at `s[open]` (`(` or `{`), skipping
/// quotes and nested expansions; `s.len()` if none (the lexer checked every word).
fn closing(s: &[char], open: usize) -> usize {
    let (o, c) = (s[open], if s[open] == '(' { ')' } else { '}' });
    let mut depth = 0;
    let mut i = open;
    while i < s.len() {
        match s[i] {
            '\\' => i += 1,
            '\'' => i = find(s, i + 1, '\''),
            '"' => i = dq_end(s, i),
            ch if ch == o => depth += 1,
            ch if ch == c => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
        i += 1;
    }
    s.len()
}

fn find(s: &[char], from: usize, c: char) -> usize {
    (from..s.len()).find(|&i| s[i] == c).unwrap_or(s.len())
}

/// The index of the `"` closing the one at `s[open]`.
fn dq_end(s: &[char], open: usize) -> usize {
    let mut i = open + 1;
    while i < s.len() {
        match s[i] {
            '\\' => i += 1,
            '"' => return i,
            '$' if matches!(s.get(i + 1), Some('(' | '{')) => i = closing(s, i + 1),
            '`' => i = find(s, i + 1, '`'),
            _ => {}
        }
        i += 1;
    }
    s.len()
}

fn text(s: &[char]) -> String {
    s.iter().collect()
}

impl<'a> Shell<'a> {
    pub(super) fn new(env: Env<'a>) -> Shell<'a> {
        Shell {
            vars: HashMap::new(),
            args: env.args.to_vec(),
            env,
            opaque: None,
            moved: None,
            unset_is_empty: false,
            maybe: None,
            args_unknown: None,
        }
    }

    /// The fields `raw` expands to (unquoted expansions split at blanks, as in a command's
    /// arguments).
    pub(super) fn fields(&mut self, raw: &str) -> Result<Vec<String>, String> {
        let mut out = Fields::default();
        self.walk(&raw.chars().collect::<Vec<_>>(), &mut out, true)?;
        Ok(out.finish())
    }

    /// `raw` expanded as one string (an assignment's value, a test's operand: no splitting).
    pub(super) fn string(&mut self, raw: &str) -> Result<String, String> {
        let mut out = Fields::default();
        self.walk(&raw.chars().collect::<Vec<_>>(), &mut out, false)?;
        Ok(out.finish().join(" "))
    }

    fn walk(&mut self, s: &[char], out: &mut Fields, split: bool) -> Result<(), String> {
        let mut i = 0;
        while i < s.len() {
            match s[i] {
                '\'' => {
                    let end = find(s, i + 1, '\'');
                    out.lit(&text(&s[i + 1..end]));
                    i = end + 1;
                }
                '"' => {
                    let end = dq_end(s, i);
                    self.walk_quoted(&s[i + 1..end.min(s.len())], out)?;
                    i = end + 1;
                }
                '\\' => {
                    if let Some(c) = s.get(i + 1) {
                        out.lit(&c.to_string());
                    }
                    i += 2;
                }
                '$' => {
                    let (val, next) = self.dollar(s, i, split)?;
                    match val {
                        Val::Fields(items) => {
                            for (k, v) in items.iter().enumerate() {
                                if k > 0 {
                                    out.end();
                                }
                                out.lit(v);
                            }
                        }
                        Val::Str(v) if split => out.split(&v),
                        Val::Str(v) => out.lit(&v),
                        Val::List(items) if split => {
                            for (k, v) in items.iter().enumerate() {
                                if k > 0 {
                                    out.end();
                                }
                                out.split(v);
                            }
                        }
                        Val::List(items) => out.lit(&items.join(" ")),
                    }
                    i = next;
                }
                '`' => {
                    let end = find(s, i + 1, '`');
                    return Err(command_output(&text(&s[i + 1..end])));
                }
                '~' if i == 0 && s.get(1).is_none_or(|c| *c == '/') => {
                    out.lit(&self.home()?);
                    i += 1;
                }
                c => {
                    out.lit(&c.to_string());
                    i += 1;
                }
            }
        }
        Ok(())
    }

    /// The inside of a double-quoted part.
    fn walk_quoted(&mut self, s: &[char], out: &mut Fields) -> Result<(), String> {
        // `""` is one empty field, `"$@"` with no arguments none
        let mut list = false;
        let mut i = 0;
        while i < s.len() {
            match s[i] {
                '\\' if matches!(s.get(i + 1), Some('$' | '`' | '"' | '\\' | '\n')) => {
                    out.lit(&s[i + 1].to_string());
                    i += 2;
                }
                '$' => {
                    let (val, next) = self.dollar(s, i, false)?;
                    match val {
                        Val::Str(v) => out.lit(&v),
                        Val::Fields(items) => out.lit(&items.join(" ")),
                        Val::List(items) => {
                            list = true;
                            out.list(&items)
                        }
                    }
                    i = next;
                }
                '`' => {
                    let end = find(s, i + 1, '`');
                    return Err(command_output(&text(&s[i + 1..end])));
                }
                c => {
                    out.lit(&c.to_string());
                    i += 1;
                }
            }
        }
        if !list {
            out.lit("");
        }
        Ok(())
    }

    fn home(&self) -> Result<String, String> {
        self.lookup_str("HOME")
            .ok_or_else(|| "`~` needs `$HOME`, which is not set in the environment".to_owned())
    }

    /// The expansion starting at `s[i] == '$'`, and the index after it.
    fn dollar(&mut self, s: &[char], i: usize, split: bool) -> Result<(Val, usize), String> {
        match s.get(i + 1) {
            Some('(') if s.get(i + 2) == Some(&'(') => {
                let end = closing(s, i + 1);
                let inner = text(&s[i + 3..end.saturating_sub(1).max(i + 3)]);
                let n = self.arithmetic(&inner)?;
                Ok((Val::Str(n.to_string()), end + 1))
            }
            Some('(') => {
                let end = closing(s, i + 1);
                let cmd = text(&s[i + 2..end.min(s.len())]);
                if cmd.trim() == "pwd" {
                    if let Some(why) = &self.moved {
                        return Err(format!("`$(pwd)` after {why}"));
                    }
                    let cwd = self
                        .env
                        .cwd
                        .clone()
                        .ok_or("`$(pwd)`: no current directory")?;
                    return Ok((Val::Str(cwd), end + 1));
                }
                Err(command_output(&cmd))
            }
            Some('{') => {
                let end = closing(s, i + 1);
                let body = text(&s[i + 2..end.min(s.len())]);
                Ok((self.braced(&body, split)?, end + 1))
            }
            Some(c) if c.is_ascii_alphabetic() || *c == '_' => {
                let end = (i + 1..s.len())
                    .find(|&j| !(s[j].is_ascii_alphanumeric() || s[j] == '_'))
                    .unwrap_or(s.len());
                let name = text(&s[i + 1..end]);
                Ok((self.value(&name, None, &format!("${name}"))?, end))
            }
            Some(c)
                if c.is_ascii_digit() || matches!(c, '@' | '*' | '#' | '?' | '$' | '!' | '-') =>
            {
                let name = c.to_string();
                Ok((self.value(&name, None, &format!("${name}"))?, i + 2))
            }
            _ => Ok((Val::Str("$".into()), i + 1)),
        }
    }

    /// `name` (with `index`) as a value; unset or unknown is an `Err` naming `shown`.
    fn value(&mut self, name: &str, index: Option<&str>, shown: &str) -> Result<Val, String> {
        match self.lookup(name, index)? {
            Lookup::Set(v) => Ok(v),
            Lookup::Unknown(why) => Err(why),
            Lookup::Unset if self.unset_is_empty => Ok(Val::Str(String::new())),
            Lookup::Unset => Err(self.unset(name, shown)),
        }
    }

    fn unset(&self, name: &str, shown: &str) -> String {
        if name.chars().all(|c| c.is_ascii_digit()) {
            return format!(
                "`{shown}` is the script's argument {name}, and it was given {} (give them \
                 after the script: `harness config from-verl SCRIPT ARG...`)",
                self.args.len()
            );
        }
        let mut why = format!("`{shown}` is set neither by the script nor in the environment");
        if let Some(o) = &self.opaque {
            why.push_str(&format!(" (unless {o}, not read here)"));
        }
        why
    }

    pub(super) fn lookup_str(&self, name: &str) -> Option<String> {
        match self.vars.get(name) {
            Some(Var::Str(s)) => Some(s.clone()),
            Some(Var::Array(a)) => a.first().cloned(),
            Some(Var::Unknown(_)) => None,
            None => (self.env.var)(name),
        }
    }

    fn lookup(&self, name: &str, index: Option<&str>) -> Result<Lookup, String> {
        let at = |items: &[String]| -> Result<Lookup, String> {
            match index {
                Some("@") => return Ok(Lookup::Set(Val::List(items.to_vec()))),
                // `"${a[*]}"`: one word, the elements joined
                Some("*") => return Ok(Lookup::Set(Val::Str(items.join(" ")))),
                _ => {}
            }
            let n = match index {
                None => 0,
                Some(i) => i
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| format!("`{name}[{i}]`: an index not followed here"))?,
            };
            Ok(items
                .get(n)
                .map_or(Lookup::Unset, |v| Lookup::Set(Val::Str(v.clone()))))
        };
        let positional =
            name.chars().all(|c| c.is_ascii_digit()) || matches!(name, "@" | "*" | "#");
        if let Some(why) = self
            .args_unknown
            .as_ref()
            .filter(|_| positional && name != "0")
        {
            return Ok(Lookup::Unknown(why.clone()));
        }
        if let Some(why) = self
            .moved
            .as_ref()
            .filter(|_| matches!(name, "PWD" | "OLDPWD"))
        {
            return Ok(Lookup::Unknown(format!("`${name}` after {why}")));
        }
        match name {
            "@" => return Ok(Lookup::Set(Val::List(self.args.clone()))),
            "*" => return Ok(Lookup::Set(Val::Str(self.args.join(" ")))),
            "#" => return Ok(Lookup::Set(Val::Str(self.args.len().to_string()))),
            "0" | "?" | "$" | "!" | "-" => {
                return Ok(Lookup::Unknown(format!(
                    "`${name}` is known only while the script runs"
                )));
            }
            _ if name.chars().all(|c| c.is_ascii_digit()) => {
                let arg = name
                    .parse::<usize>()
                    .ok()
                    .and_then(|n| self.args.get(n.checked_sub(1)?));
                return at(&arg.into_iter().cloned().collect::<Vec<_>>());
            }
            _ => {}
        }
        match self.vars.get(name) {
            Some(Var::Str(s)) => at(std::slice::from_ref(s)),
            Some(Var::Array(items)) => at(items),
            Some(Var::Unknown(why)) => Ok(Lookup::Unknown(why.clone())),
            None => match (self.env.var)(name) {
                Some(v) => at(&[v]),
                None => Ok(Lookup::Unset),
            },
        }
    }

    /// `${body}`.
    fn braced(&mut self, body: &str, split: bool) -> Result<Val, String> {
        let shown = format!("${{{body}}}");
        let unsupported = || format!("`{shown}`: a form of expansion not followed here");
        if let Some(name) = body
            .strip_prefix('#')
            .filter(|n| is_name(n) || n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty())
        {
            return match self.value(name, None, &shown)? {
                Val::Str(s) => Ok(Val::Str(s.chars().count().to_string())),
                Val::List(l) | Val::Fields(l) => Ok(Val::Str(l.len().to_string())),
            };
        }
        let b: Vec<char> = body.chars().collect();
        let mut n = b
            .iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
            .unwrap_or(b.len());
        if n == 0 && matches!(b.first(), Some('@' | '*' | '#' | '?' | '$' | '!' | '-')) {
            n = 1;
        }
        let name = text(&b[..n]);
        if name.is_empty()
            || !(is_name(&name) || n == 1 || name.chars().all(|c| c.is_ascii_digit()))
        {
            return Err(unsupported());
        }
        let mut rest = &b[n..];
        let mut index = None;
        if rest.first() == Some(&'[') {
            let close = rest
                .iter()
                .position(|c| *c == ']')
                .ok_or_else(unsupported)?;
            index = Some(text(&rest[1..close]));
            rest = &rest[close + 1..];
        }
        let found = self.lookup(&name, index.as_deref())?;
        let op = text(rest);
        let set_value = |found: &Lookup| match found {
            Lookup::Set(Val::Str(s)) => Some(s.clone()),
            Lookup::Set(Val::List(l) | Val::Fields(l)) => Some(l.join(" ")),
            _ => None,
        };
        let colon = op.starts_with(':');
        let plain = op.strip_prefix(':').unwrap_or(&op);
        if let Lookup::Unknown(why) = &found
            && !plain.starts_with('+')
        {
            return Err(why.clone());
        }
        let is_unset = |found: &Lookup| match found {
            Lookup::Unset => true,
            Lookup::Set(_) if colon => set_value(found).is_some_and(|v| v.is_empty()),
            _ => false,
        };
        if op.is_empty() {
            return match found {
                Lookup::Set(v) => Ok(v),
                _ => self.value(&name, index.as_deref(), &shown),
            };
        }
        match plain.chars().next() {
            Some('-') => {
                if is_unset(&found) {
                    return self.word_val(&plain[1..], split);
                }
                Ok(self.value(&name, index.as_deref(), &shown)?)
            }
            Some('=') => {
                if is_unset(&found) {
                    let v = self.string(&plain[1..])?;
                    let var = match &self.maybe {
                        Some(m) => Var::Unknown(format!("`${name}` is set {m}")),
                        None => Var::Str(v.clone()),
                    };
                    self.vars.insert(name, var);
                    return Ok(Val::Str(v));
                }
                Ok(self.value(&name, index.as_deref(), &shown)?)
            }
            Some('+') => {
                if let Lookup::Unknown(why) = &found {
                    return Err(why.clone());
                }
                if is_unset(&found) {
                    return Ok(Val::Str(String::new()));
                }
                self.word_val(&plain[1..], split)
            }
            Some('?') => {
                if is_unset(&found) {
                    let msg = self.string(&plain[1..]).unwrap_or_default();
                    return Err(format!("`{shown}`: the script stops here ({msg})"));
                }
                Ok(self.value(&name, index.as_deref(), &shown)?)
            }
            _ if colon => {
                // ${name:offset} / ${name:offset:length}: characters of a string, elements of
                // a list (`${@:2}` from the second argument on)
                let mut parts = plain.splitn(2, ':');
                let mut off: i64 = self.arithmetic(parts.next().unwrap_or("0"))?;
                let count = parts.next().map(|l| self.arithmetic(l)).transpose()?;
                let span = |len: usize, off: i64| {
                    let len = len as i64;
                    let start = if off < 0 {
                        len.saturating_add(off).max(0)
                    } else {
                        off.min(len)
                    };
                    let end = match count {
                        Some(l) if l < 0 => len.saturating_add(l).max(start),
                        Some(l) => start.saturating_add(l).min(len),
                        None => len,
                    };
                    start as usize..end.max(start) as usize
                };
                match found {
                    Lookup::Set(Val::List(l)) => {
                        if name == "@" {
                            // `$@`'s offset counts `$0`, which is not among the arguments
                            if off == 0 {
                                return Err(format!(
                                    "`{shown}`: `$0` is known only while the script runs"
                                ));
                            }
                            off = if off > 0 { off - 1 } else { off };
                        }
                        Ok(Val::List(l[span(l.len(), off)].to_vec()))
                    }
                    _ => {
                        let v = set_value(&found).ok_or_else(|| self.unset(&name, &shown))?;
                        let chars: Vec<char> = v.chars().collect();
                        Ok(Val::Str(text(&chars[span(chars.len(), off)])))
                    }
                }
            }
            Some('#' | '%') => {
                let suffix = op.starts_with('%');
                let longest = op.len() > 1 && op.as_bytes()[1] == op.as_bytes()[0];
                let pattern: Vec<char> = self
                    .string(&op[if longest { 2 } else { 1 }..])?
                    .chars()
                    .collect();
                let trim = |v: &str| trim_glob(v, &pattern, suffix, longest);
                match self.value(&name, index.as_deref(), &shown)? {
                    Val::Str(v) => Ok(Val::Str(trim(&v))),
                    Val::List(l) | Val::Fields(l) => {
                        Ok(Val::List(l.iter().map(|v| trim(v)).collect()))
                    }
                }
            }
            Some('/') => {
                let all = op.starts_with("//");
                let spec = &op[if all { 2 } else { 1 }..];
                let (pat, rep) = spec.split_once('/').unwrap_or((spec, ""));
                if pat.starts_with(['#', '%'])
                    || pat.contains(['*', '?', '[', '\\'])
                    || rep.contains('\\')
                {
                    return Err(unsupported());
                }
                let (pat, rep) = (self.string(pat)?, self.string(rep)?);
                let replace = |v: &str| {
                    if pat.is_empty() {
                        v.to_owned()
                    } else if all {
                        v.replace(&pat, &rep)
                    } else {
                        v.replacen(&pat, &rep, 1)
                    }
                };
                match self.value(&name, index.as_deref(), &shown)? {
                    Val::Str(v) => Ok(Val::Str(replace(&v))),
                    Val::List(l) | Val::Fields(l) => {
                        Ok(Val::List(l.iter().map(|v| replace(v)).collect()))
                    }
                }
            }
            Some(',' | '^') if matches!(op.as_str(), ",," | "^^" | "," | "^") => {
                let v = set_value(&found).ok_or_else(|| self.unset(&name, &shown))?;
                let first_only = op.len() == 1;
                let f = |c: char| {
                    if op.starts_with(',') {
                        c.to_lowercase().collect::<String>()
                    } else {
                        c.to_uppercase().collect()
                    }
                };
                let out = if first_only {
                    let mut cs = v.chars();
                    cs.next().map(|c| f(c) + cs.as_str()).unwrap_or_default()
                } else {
                    v.chars().map(f).collect()
                };
                Ok(Val::Str(out))
            }
            _ => Err(unsupported()),
        }
    }

    /// `raw` as a pattern of `[[ x == raw ]]`: its quoted parts literal (escaped), what it
    /// expands to unquoted a pattern.
    pub(super) fn pattern(&mut self, raw: &str) -> Result<String, String> {
        let s: Vec<char> = raw.chars().collect();
        let mut out = String::new();
        let literal = |t: &str, out: &mut String| {
            for c in t.chars() {
                if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                    out.push('\\');
                }
                out.push(c);
            }
        };
        let mut i = 0;
        while i < s.len() {
            match s[i] {
                '\'' => {
                    let end = find(&s, i + 1, '\'');
                    literal(&text(&s[i + 1..end]), &mut out);
                    i = end + 1;
                }
                '"' => {
                    let end = dq_end(&s, i);
                    let v = self.string(&text(&s[i..(end + 1).min(s.len())]))?;
                    literal(&v, &mut out);
                    i = end + 1;
                }
                '\\' => {
                    if let Some(c) = s.get(i + 1) {
                        literal(&c.to_string(), &mut out);
                    }
                    i += 2;
                }
                '$' => {
                    let (val, next) = self.dollar(&s, i, false)?;
                    out.push_str(&match val {
                        Val::Str(v) => v,
                        Val::List(l) | Val::Fields(l) => l.join(" "),
                    });
                    i = next;
                }
                c => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        Ok(out)
    }

    /// The word of `${x:-word}` or `${x:+word}`: split where its own quotes allow when the
    /// expansion is unquoted, one string inside double quotes.
    fn word_val(&mut self, word: &str, split: bool) -> Result<Val, String> {
        Ok(if split {
            Val::Fields(self.fields(word)?)
        } else {
            Val::Str(self.string(word)?)
        })
    }

    /// `$((expr))`: integers with `+ - * / % **`, comparisons and parentheses; a name reads
    /// its variable.
    pub(super) fn arithmetic(&mut self, expr: &str) -> Result<i64, String> {
        let expanded = self.string(expr)?;
        let toks = arith_tokens(&expanded)
            .ok_or_else(|| format!("`$(({expr}))`: not arithmetic followed here"))?;
        let mut p = Arith {
            toks: &toks,
            i: 0,
            shell: self,
            expr,
            depth: 0,
        };
        let v = p.compare()?;
        if p.i != toks.len() {
            return Err(format!("`$(({expr}))`: not arithmetic followed here"));
        }
        Ok(v)
    }
}

fn command_output(cmd: &str) -> String {
    format!(
        "`$({})` is a command's output, which is not run here",
        cmd.trim()
    )
}

/// `v` less the shortest or longest prefix (suffix) matching the glob `pattern`.
fn trim_glob(v: &str, pattern: &[char], suffix: bool, longest: bool) -> String {
    let chars: Vec<char> = v.chars().collect();
    let n = chars.len();
    let mut cuts: Vec<usize> = (0..=n).collect();
    if longest {
        cuts.reverse();
    }
    for k in cuts {
        let (part, kept) = if suffix {
            (&chars[n - k..], &chars[..n - k])
        } else {
            (&chars[..k], &chars[k..])
        };
        if glob(pattern, part) {
            return text(kept);
        }
    }
    v.to_owned()
}

/// Whether `s` matches the glob `p`: `*`, `?`, `[...]` (ranges, `!`/`^` negation), `\x` a
/// literal `x`, other characters themselves.
pub(super) fn glob(p: &[char], s: &[char]) -> bool {
    match p.first() {
        None => s.is_empty(),
        Some('*') => (0..=s.len()).any(|k| glob(&p[1..], &s[k..])),
        Some('?') => !s.is_empty() && glob(&p[1..], &s[1..]),
        Some('\\') if p.len() > 1 => s.first() == Some(&p[1]) && glob(&p[2..], &s[1..]),
        Some('[') => match (class_end(p), s.first()) {
            (Some(end), Some(c)) => in_class(&p[1..end], *c) && glob(&p[end + 1..], &s[1..]),
            (Some(_), None) => false,
            (None, _) => s.first() == Some(&'[') && glob(&p[1..], &s[1..]),
        },
        Some(c) => s.first() == Some(c) && glob(&p[1..], &s[1..]),
    }
}

/// The index of the `]` closing the class opened at `p[0]`.
fn class_end(p: &[char]) -> Option<usize> {
    let mut i = 1;
    if matches!(p.get(i), Some('!' | '^')) {
        i += 1;
    }
    if p.get(i) == Some(&']') {
        i += 1;
    }
    (i..p.len()).find(|&j| p[j] == ']')
}

fn in_class(class: &[char], c: char) -> bool {
    let (negate, class) = match class.first() {
        Some('!' | '^') => (true, &class[1..]),
        _ => (false, class),
    };
    let mut i = 0;
    let mut found = false;
    while i < class.len() {
        if i + 2 < class.len() && class[i + 1] == '-' {
            found |= class[i] <= c && c <= class[i + 2];
            i += 3;
        } else {
            found |= class[i] == c;
            i += 1;
        }
    }
    found != negate
}

#[derive(Debug, Clone, PartialEq)]
enum At {
    Num(i64),
    Name(String),
    Op(&'static str),
}

fn arith_tokens(s: &str) -> Option<Vec<At>> {
    const OPS: [&str; 15] = [
        "**", "<=", ">=", "==", "!=", "+", "-", "*", "/", "%", "(", ")", "<", ">", "!",
    ];
    let c: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if c[i].is_whitespace() {
            i += 1;
        } else if c[i].is_ascii_digit() {
            let end = (i..c.len())
                .find(|&j| !c[j].is_ascii_digit())
                .unwrap_or(c.len());
            let digits = text(&c[i..end]);
            // bash reads 010 as octal
            let n = if digits.len() > 1 && digits.starts_with('0') {
                i64::from_str_radix(&digits[1..], 8).ok()?
            } else {
                digits.parse().ok()?
            };
            out.push(At::Num(n));
            i = end;
        } else if c[i].is_ascii_alphabetic() || c[i] == '_' {
            let end = (i..c.len())
                .find(|&j| !(c[j].is_ascii_alphanumeric() || c[j] == '_'))
                .unwrap_or(c.len());
            out.push(At::Name(text(&c[i..end])));
            i = end;
        } else {
            let op = OPS
                .iter()
                .find(|op| text(&c[i..(i + op.len()).min(c.len())]) == **op)?;
            out.push(At::Op(op));
            i += op.len();
        }
    }
    Some(out)
}

struct Arith<'s, 'a, 'b> {
    toks: &'s [At],
    i: usize,
    shell: &'s mut Shell<'a>,
    expr: &'b str,
    depth: usize,
}

impl Arith<'_, '_, '_> {
    fn bad(&self) -> String {
        format!("`$(({}))`: not arithmetic followed here", self.expr)
    }

    fn eat(&mut self, op: &str) -> bool {
        let found = matches!(self.toks.get(self.i), Some(At::Op(o)) if *o == op);
        self.i += usize::from(found);
        found
    }

    fn peek_op(&self) -> Option<&'static str> {
        match self.toks.get(self.i) {
            Some(At::Op(o)) => Some(o),
            _ => None,
        }
    }

    fn compare(&mut self) -> Result<i64, String> {
        let mut v = self.relation()?;
        while let Some(op @ ("==" | "!=")) = self.peek_op() {
            self.i += 1;
            let r = self.relation()?;
            v = i64::from(if op == "==" { v == r } else { v != r });
        }
        Ok(v)
    }

    fn relation(&mut self) -> Result<i64, String> {
        let mut v = self.sum()?;
        while let Some(op @ ("<" | ">" | "<=" | ">=")) = self.peek_op() {
            self.i += 1;
            let r = self.sum()?;
            v = i64::from(match op {
                "<" => v < r,
                ">" => v > r,
                "<=" => v <= r,
                _ => v >= r,
            });
        }
        Ok(v)
    }

    fn sum(&mut self) -> Result<i64, String> {
        let mut v = self.product()?;
        while let Some(op @ ("+" | "-")) = self.peek_op() {
            self.i += 1;
            let r = self.product()?;
            v = if op == "+" {
                v.checked_add(r)
            } else {
                v.checked_sub(r)
            }
            .ok_or_else(|| self.bad())?;
        }
        Ok(v)
    }

    fn product(&mut self) -> Result<i64, String> {
        let mut v = self.power()?;
        while let Some(op @ ("*" | "/" | "%")) = self.peek_op() {
            self.i += 1;
            let r = self.power()?;
            v = match op {
                "*" => v.checked_mul(r),
                "/" => v.checked_div(r),
                _ => v.checked_rem(r),
            }
            .ok_or_else(|| format!("`$(({}))`: division by zero or overflow", self.expr))?;
        }
        Ok(v)
    }

    fn power(&mut self) -> Result<i64, String> {
        let base = self.unary()?;
        if self.peek_op() == Some("**") {
            self.i += 1;
            let e = self.power()?;
            return u32::try_from(e)
                .ok()
                .and_then(|e| base.checked_pow(e))
                .ok_or_else(|| self.bad());
        }
        Ok(base)
    }

    fn unary(&mut self) -> Result<i64, String> {
        match self.peek_op() {
            Some("-") => {
                self.i += 1;
                self.unary()?.checked_neg().ok_or_else(|| self.bad())
            }
            Some("+") => {
                self.i += 1;
                self.unary()
            }
            Some("!") => {
                self.i += 1;
                Ok(i64::from(self.unary()? == 0))
            }
            Some("(") => {
                self.i += 1;
                let v = self.compare()?;
                if !self.eat(")") {
                    return Err(self.bad());
                }
                Ok(v)
            }
            _ => match self.toks.get(self.i).cloned() {
                Some(At::Num(n)) => {
                    self.i += 1;
                    Ok(n)
                }
                Some(At::Name(name)) => {
                    self.i += 1;
                    let v = match self.shell.value(&name, None, &name)? {
                        Val::Str(v) => v,
                        Val::List(l) | Val::Fields(l) => l.first().cloned().unwrap_or_default(),
                    };
                    if self.depth > 8 {
                        return Err(self.bad());
                    }
                    let toks = arith_tokens(&v).ok_or_else(|| self.bad())?;
                    let mut inner = Arith {
                        toks: &toks,
                        i: 0,
                        shell: self.shell,
                        expr: self.expr,
                        depth: self.depth + 1,
                    };
                    let r = inner.compare()?;
                    if inner.i != toks.len() {
                        return Err(format!(
                            "`{name}` = `{v}` is not a number, in `$(({}))`",
                            self.expr
                        ));
                    }
                    Ok(r)
                }
                _ => Err(self.bad()),
            },
        }
    }
}
