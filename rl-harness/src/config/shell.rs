//! A verl launch script read as bash runs it (with the arguments and environment [`Env`]
//! gives), as far as its verl command: the variables it sets (plain, `export`ed, arrays,
//! `${x:-default}`, `$((...))`), the `if`/`elif`/`else` branches whose conditions are tests of
//! strings and numbers, and the arguments of the first command that runs verl's entry point,
//! expanded. Nothing is executed: another command's output, a branch whose condition is not a
//! test, a loop or `case`, a function's body, or a file the script `source`s is not followed,
//! and a variable that depends on one is reported as unknown with the reason, never guessed
//! (after a `source` or `eval`, a variable the script never sets is unknown; one it set before
//! is taken as it set it).

mod expand;
mod lex;

pub use expand::Env;
use expand::{Shell, Var, glob};
use lex::{Tok, is_name};

use anyhow::Result;

/// The verl command a script runs.
#[derive(Debug)]
pub(crate) struct Launch {
    /// The command's arguments after the entry point.
    pub args: Vec<Arg>,
    /// The entry point as the script names it.
    pub entry: String,
    /// Why the command may not run as read: it sits in a branch not followed here.
    pub conditional: Option<String>,
    /// A config-like word starting the command after it (its line, the word): the verl
    /// command ended a line early, as where a `\` is followed by blanks or a comment.
    pub cut: Option<(usize, String)>,
}

/// One argument of the verl command.
#[derive(Debug, PartialEq)]
pub(crate) enum Arg {
    /// The argument as bash passes it, and the word it came from where that differs and gave
    /// this argument alone.
    Text { text: String, from: Option<String> },
    /// A word that could not be expanded here, and why.
    Unread { raw: String, why: String },
}

/// Whether a branch of the script runs.
#[derive(Debug, Clone)]
enum Branch {
    Run,
    Skip,
    /// It may or may not, for this reason.
    Maybe(String),
}

/// Whether an earlier branch of an `if` ran.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Prior {
    No,
    Yes,
    Maybe,
}

#[derive(Debug)]
enum Frame {
    If {
        /// Reading its condition (before `then`).
        testing: bool,
        cond: Option<bool>,
        cond_text: String,
        line: usize,
        branch: Branch,
        prior: Prior,
    },
    Loop(usize),
    Case(usize),
    Func {
        name: String,
        open: bool,
    },
    /// `{ ...; }`, and whether it runs (after `&&` or `||`).
    Brace(Branch),
    /// `( ... )`: whether it runs, and the variables and arguments it restores when it ends.
    Subshell {
        branch: Branch,
        saved: Box<(std::collections::HashMap<String, Var>, Vec<String>)>,
    },
}

/// How a command joins the one before it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Join {
    Start,
    And,
    Or,
    Pipe,
}

struct Reader<'a, 'e> {
    shell: Shell<'e>,
    frames: Vec<Frame>,
    /// The last command's success, where known.
    status: Option<bool>,
    is_entry: &'a dyn Fn(&str) -> bool,
    /// A verl command inside a function's definition: the launch if no other runs.
    in_function: Option<Launch>,
}

/// The first verl command `text` runs (a script, or a command line), with its arguments
/// expanded in `env`; `None` when it runs none. A script bash could not read (an unclosed
/// quote or bracket) is an error naming the line.
pub(crate) fn launch(
    text: &str,
    env: Env<'_>,
    is_entry: &dyn Fn(&str) -> bool,
) -> Result<Option<Launch>> {
    let toks = lex::lex(text)?;
    let mut r = Reader {
        shell: Shell::new(env),
        frames: Vec::new(),
        status: Some(true),
        is_entry,
        in_function: None,
    };
    // a command's words and array assignments
    let mut cmd: Vec<Tok> = Vec::new();
    let mut join = Join::Start;
    let mut toks = toks.into_iter();
    while let Some(tok) = toks.next() {
        let next = match tok {
            Tok::Word(..) | Tok::Array { .. } => {
                cmd.push(tok);
                continue;
            }
            Tok::Func(name, _) => {
                r.frames.push(Frame::Func { name, open: false });
                continue;
            }
            Tok::Sep | Tok::Close | Tok::Open => Join::Start,
            Tok::And => Join::And,
            Tok::Or => Join::Or,
            Tok::Pipe => Join::Pipe,
        };
        if let Some(mut found) = r.command(std::mem::take(&mut cmd), join) {
            if tok == Tok::Sep {
                found.cut = toks.find(|t| *t != Tok::Sep).and_then(|t| match t {
                    Tok::Word(w, line) if continues(&w) => Some((line, w)),
                    _ => None,
                });
            }
            return Ok(Some(found));
        }
        match tok {
            Tok::Open => {
                let branch = r.joined(join, 0);
                let saved = Box::new((r.shell.vars.clone(), r.shell.args.clone()));
                r.frames.push(Frame::Subshell { branch, saved });
            }
            Tok::Close => {
                if let Some(Frame::Subshell { saved, .. }) = r.frames.last() {
                    // a subshell's assignments end with it
                    (r.shell.vars, r.shell.args) = (**saved).clone();
                    r.frames.pop();
                }
            }
            _ => {}
        }
        join = next;
    }
    Ok(r.command(cmd, join).or(r.in_function))
}

impl Reader<'_, '_> {
    /// Whether the current point of the script runs, from its enclosing frames.
    fn branch(&self) -> Branch {
        let mut maybe = None;
        for f in &self.frames {
            let b = match f {
                Frame::If {
                    testing: false,
                    branch,
                    ..
                } => branch.clone(),
                Frame::Brace(branch) | Frame::Subshell { branch, .. } => branch.clone(),
                Frame::If { .. } => Branch::Run,
                Frame::Loop(line) => Branch::Maybe(format!("inside the loop at line {line}")),
                Frame::Case(line) => Branch::Maybe(format!("inside the `case` at line {line}")),
                Frame::Func { name, .. } => Branch::Maybe(format!(
                    "inside the function `{name}`, which runs only where it is called"
                )),
            };
            match b {
                Branch::Skip => return Branch::Skip,
                Branch::Maybe(why) if maybe.is_none() => maybe = Some(why),
                _ => {}
            }
        }
        maybe.map_or(Branch::Run, Branch::Maybe)
    }

    /// Whether a command joined to the last one by `join` runs, by that command's success.
    fn joined(&self, join: Join, line: usize) -> Branch {
        match (join, self.status) {
            (Join::And, Some(false)) | (Join::Or, Some(true)) => Branch::Skip,
            (Join::And | Join::Or, None) => Branch::Maybe(format!(
                "after `&&` or `||` on line {line}, following a command whose success is not known here"
            )),
            _ => Branch::Run,
        }
    }

    /// Reads one command; the launch if it is verl's.
    fn command(&mut self, items: Vec<Tok>, join: Join) -> Option<Launch> {
        let mut joined = self.joined(join, line_of(&items));
        let mut items = items.into_iter().peekable();
        let mut negate = false;
        // leading keywords
        while let Some(Tok::Word(w, line)) = items.peek() {
            let (w, line) = (w.clone(), *line);
            match w.as_str() {
                "if" | "elif" => {
                    items.next();
                    if w == "if" {
                        self.frames.push(Frame::If {
                            testing: true,
                            cond: None,
                            cond_text: String::new(),
                            line,
                            branch: Branch::Skip,
                            prior: Prior::No,
                        });
                    }
                    let words: Vec<String> = items
                        .by_ref()
                        .take_while(|i| !matches!(i, Tok::Word(w, _) if w == "then"))
                        .filter_map(|i| match i {
                            Tok::Word(w, _) => Some(w),
                            _ => None,
                        })
                        .collect();
                    let text = words.iter().map(String::as_str).collect::<Vec<_>>();
                    let cond = self.test(&text);
                    if let Some(Frame::If {
                        testing,
                        cond: c,
                        cond_text,
                        line: l,
                        ..
                    }) = self.frames.last_mut()
                    {
                        *testing = true;
                        *c = cond;
                        *cond_text = text.join(" ");
                        *l = line;
                    }
                    return None;
                }
                "then" => {
                    items.next();
                    self.enter_branch(None);
                }
                "else" => {
                    items.next();
                    self.enter_branch(Some(true));
                }
                "fi" => {
                    items.next();
                    self.pop_to(|f| matches!(f, Frame::If { .. }));
                }
                "for" | "while" | "until" | "select" => {
                    self.frames.push(Frame::Loop(line));
                    return None;
                }
                "do" => {
                    items.next();
                }
                "done" => {
                    items.next();
                    self.pop_to(|f| matches!(f, Frame::Loop(_)));
                }
                "case" => {
                    self.frames.push(Frame::Case(line));
                    return None;
                }
                "esac" => {
                    items.next();
                    self.pop_to(|f| matches!(f, Frame::Case(_)));
                }
                "function" => {
                    items.next();
                    // `function name() {` came as a function head already
                    if !matches!(self.frames.last(), Some(Frame::Func { open: false, .. })) {
                        let name =
                            match items.next_if(|i| !matches!(i, Tok::Word(w, _) if w == "{")) {
                                Some(Tok::Word(n, _)) => n,
                                _ => String::new(),
                            };
                        self.frames.push(Frame::Func { name, open: false });
                    }
                }
                "{" => {
                    items.next();
                    match self.frames.last_mut() {
                        Some(Frame::Func { open, .. }) if !*open => *open = true,
                        // the group is what `&&`/`||` joined
                        _ => self
                            .frames
                            .push(Frame::Brace(std::mem::replace(&mut joined, Branch::Run))),
                    }
                }
                "}" => {
                    items.next();
                    self.frames.pop();
                }
                "!" => {
                    items.next();
                    negate = !negate;
                }
                _ => break,
            }
        }
        let items: Vec<Tok> = items.collect();
        if items.is_empty() {
            return None;
        }
        if let Some(Frame::If {
            testing: true,
            cond,
            ..
        }) = self.frames.last_mut()
        {
            // a condition of more than one test: not followed
            *cond = None;
        }
        let branch = match (self.branch(), joined) {
            (Branch::Skip, _) | (_, Branch::Skip) => Branch::Skip,
            (Branch::Maybe(w), _) | (_, Branch::Maybe(w)) => Branch::Maybe(w),
            _ => Branch::Run,
        };
        if matches!(branch, Branch::Skip) {
            return None;
        }
        let maybe = match &branch {
            Branch::Maybe(w) => Some(w.clone()),
            _ => None,
        };
        self.shell.maybe = maybe.clone();
        let status = self.run(items, maybe);
        self.shell.maybe = None;
        match status {
            Ok(status) => self.status = status.map(|s| s != negate),
            Err(launch) => return Some(launch),
        }
        None
    }

    /// `then` (`given` None) or `else` (`given` true): the branch the `if` now reads.
    fn enter_branch(&mut self, given: Option<bool>) {
        let Some(Frame::If {
            testing,
            cond,
            cond_text,
            line,
            branch,
            prior,
        }) = self.frames.last_mut()
        else {
            return;
        };
        let cond = given.or(*cond);
        *testing = false;
        *branch = match (*prior, cond) {
            (Prior::Yes, _) => Branch::Skip,
            (Prior::No, Some(true)) => {
                *prior = Prior::Yes;
                Branch::Run
            }
            (_, Some(false)) => Branch::Skip,
            (Prior::Maybe, Some(true)) => Branch::Maybe(format!(
                "after a branch of the `if` at line {line} whose condition is not evaluated here"
            )),
            (_, None) => {
                *prior = Prior::Maybe;
                Branch::Maybe(format!(
                    "inside an `if` whose condition (`{cond_text}`, line {line}) is not evaluated here"
                ))
            }
        };
    }

    fn pop_to(&mut self, is: impl Fn(&Frame) -> bool) {
        if let Some(k) = self.frames.iter().rposition(is) {
            self.frames.truncate(k);
        }
    }

    /// Runs a command's assignments and builtins; its success where known, or `Err` with the
    /// launch when it runs verl.
    fn run(&mut self, items: Vec<Tok>, maybe: Option<String>) -> Result<Option<bool>, Launch> {
        let mut words: Vec<(String, usize)> = Vec::new();
        let mut prefix = Vec::new();
        for item in items {
            match item {
                Tok::Word(w, line) if words.is_empty() && !is_assignment_word(&w) => {
                    words.push((w, line))
                }
                Tok::Word(..) | Tok::Array { .. } if words.is_empty() => prefix.push(item),
                Tok::Word(w, line) => words.push((w, line)),
                // a command holds only words and array assignments
                _ => {}
            }
        }
        let Some((first, line)) = words.first().cloned() else {
            for item in prefix {
                self.assign_item(item, &maybe);
            }
            return Ok(Some(true));
        };
        // `X=1 cmd`: `X` is set in the command's environment alone
        if let Some(inner) = first.strip_prefix("((").and_then(|w| w.strip_suffix("))")) {
            return Ok(self.arithmetic_command(inner, line));
        }
        // verl's entry point, anywhere in the command (`python3 -m X`, `torchrun ... -m X`);
        // not in a function's definition, which runs only where it is called
        let defining = self.frames.iter().any(|f| matches!(f, Frame::Func { .. }));
        let mut before: Option<String> = None;
        let command = self.shell.string(&first).unwrap_or_default();
        let runs_python = !matches!(
            command.rsplit('/').next().unwrap_or(""),
            "pkill"
                | "pgrep"
                | "echo"
                | "printf"
                | "grep"
                | "ps"
                | "kill"
                | "cat"
                | "ls"
                | "killall"
        );
        for (k, (w, _)) in words.iter().enumerate().filter(|_| runs_python) {
            let Ok(fields) = self.shell.fields(w) else {
                before = None;
                continue;
            };
            // `-m verl.trainer.main_ppo`, or a script `.../main_ppo.py`
            let found = fields.iter().enumerate().position(|(j, f)| {
                let prev = if j == 0 {
                    before.as_deref()
                } else {
                    Some(fields[j - 1].as_str())
                };
                (self.is_entry)(f) && (prev == Some("-m") || f.ends_with(".py"))
            });
            before = fields.last().cloned();
            if let Some(at) = found {
                let mut args: Vec<Arg> = fields[at + 1..]
                    .iter()
                    .map(|f| Arg::Text {
                        text: f.clone(),
                        from: None,
                    })
                    .collect();
                for (raw, _) in &words[k + 1..] {
                    match self.shell.fields(raw) {
                        // the word is kept where it gave one argument (not an array's list)
                        Ok(fs) if fs.len() == 1 => args.extend(fs.into_iter().map(|f| Arg::Text {
                            from: Some(raw.clone()).filter(|r| *r != f),
                            text: f,
                        })),
                        Ok(fs) => {
                            args.extend(fs.into_iter().map(|text| Arg::Text { text, from: None }))
                        }
                        Err(why) => args.push(Arg::Unread {
                            raw: raw.clone(),
                            why,
                        }),
                    }
                }
                let launch = Launch {
                    args,
                    entry: fields[at].clone(),
                    conditional: maybe,
                    cut: None,
                };
                if defining {
                    // runs only where the function is called: the launch if no other runs
                    self.in_function.get_or_insert(launch);
                    return Ok(None);
                }
                return Err(launch);
            }
        }
        let name = self.shell.string(&first).unwrap_or_default();
        let rest = &words[1..];
        Ok(match name.as_str() {
            "export" | "declare" | "typeset" | "local" | "readonly" => {
                for (w, l) in rest {
                    if assignment(w).is_some() {
                        self.assign(w, *l, &maybe);
                    }
                }
                Some(true)
            }
            "unset" => {
                for (w, _) in rest {
                    let why = maybe.as_ref().map(|m| format!("`${w}` is unset {m}"));
                    match why {
                        Some(why) => self.shell.vars.insert(w.clone(), Var::Unknown(why)),
                        None => self.shell.vars.remove(w),
                    };
                }
                Some(true)
            }
            "source" | "." | "eval" => {
                let what = words
                    .iter()
                    .map(|(w, _)| w.as_str())
                    .collect::<Vec<_>>()
                    .join(" ");
                self.shell.opaque = Some(format!("`{what}` (line {line}) sets it"));
                None
            }
            "cd" | "pushd" | "popd" => {
                self.shell.moved = Some(format!("`{name}` (line {line})"));
                Some(true)
            }
            "read" | "mapfile" | "readarray" | "getopts" => {
                for (w, _) in rest.iter().filter(|(w, _)| is_name(w)) {
                    self.shell.vars.insert(
                        w.clone(),
                        Var::Unknown(format!("`${w}` is read from input (line {line})")),
                    );
                }
                None
            }
            "[" | "[[" | "test" => {
                let all: Vec<&str> = words.iter().map(|(w, _)| w.as_str()).collect();
                self.test(&all)
            }
            "set" if rest.first().is_some_and(|(w, _)| w == "--") => {
                self.shell.args_unknown = Some(format!(
                    "the script's arguments after `set --` on line {line}"
                ));
                Some(true)
            }
            "true" | ":" | "echo" | "printf" | "mkdir" | "set" | "shopt" | "ulimit" | "trap"
            | "ray" | "nvidia-smi" | "pip" | "pip3" | "sleep" | "wait" => Some(true),
            "shift" => {
                let n = match rest.first() {
                    Some((w, _)) => self
                        .shell
                        .string(w)
                        .ok()
                        .and_then(|n| n.parse::<usize>().ok()),
                    None => Some(1),
                };
                match (n, &maybe) {
                    (Some(n), None) => {
                        let n = n.min(self.shell.args.len());
                        self.shell.args.drain(..n);
                    }
                    _ => {
                        self.shell.args_unknown = Some(format!(
                            "the script's arguments after `shift` on line {line}{}",
                            maybe
                                .as_ref()
                                .map(|m| format!(", which runs only {m}"))
                                .unwrap_or_default()
                        ))
                    }
                }
                Some(true)
            }

            "false" => Some(false),
            _ => None,
        })
    }

    /// An assignment before a command's words: a variable, an array or an array's element.
    fn assign_item(&mut self, item: Tok, maybe: &Option<String>) {
        match item {
            Tok::Array {
                name,
                append,
                items,
                line,
            } => self.assign_array(&name, append, &items, line, maybe),
            Tok::Word(w, line) => match w.split_once('[').filter(|(n, _)| is_name(n)) {
                Some((name, _)) if assignment(&w).is_none() => {
                    let why =
                        format!("`${name}` has an element set on line {line}, not followed here");
                    self.shell.vars.insert(name.to_owned(), Var::Unknown(why));
                }
                _ => self.assign(&w, line, maybe),
            },
            _ => {}
        }
    }

    /// `((...))`: a test, or arithmetic that changes variables, which is not followed.
    fn arithmetic_command(&mut self, inner: &str, line: usize) -> Option<bool> {
        let assigns = inner.contains("++")
            || inner.contains("--")
            || inner.char_indices().any(|(i, c)| {
                c == '='
                    && !matches!(inner[..i].chars().last(), Some('=' | '!' | '<' | '>'))
                    && !inner[i + 1..].starts_with('=')
            });
        if !assigns {
            return self.shell.arithmetic(inner).ok().map(|v| v != 0);
        }
        for name in inner
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|n| is_name(n))
        {
            let why = format!(
                "`${name}` may be changed by `(({inner}))` on line {line}, not followed here"
            );
            self.shell.vars.insert(name.to_owned(), Var::Unknown(why));
        }
        None
    }

    fn assign(&mut self, word: &str, line: usize, maybe: &Option<String>) {
        let Some((name, append, raw)) = assignment(word) else {
            return;
        };
        let value = match maybe {
            Some(m) => Var::Unknown(format!("`${name}` is set {m}")),
            None => match self.shell.string(raw) {
                Ok(v) => match (append, self.shell.vars.get(name)) {
                    (true, Some(Var::Unknown(why))) => Var::Unknown(why.clone()),
                    (true, _) => Var::Str(format!(
                        "{}{v}",
                        self.shell.lookup_str(name).unwrap_or_default()
                    )),
                    // `a=v` on an array sets its first element
                    (false, Some(Var::Array(items))) => Var::Array(
                        std::iter::once(v)
                            .chain(items.iter().skip(1).cloned())
                            .collect(),
                    ),
                    _ => Var::Str(v),
                },
                Err(why) => Var::Unknown(format!("`${name}`, set on line {line}: {why}")),
            },
        };
        self.shell.vars.insert(name.to_owned(), value);
    }

    fn assign_array(
        &mut self,
        name: &str,
        append: bool,
        raw: &[String],
        line: usize,
        maybe: &Option<String>,
    ) {
        let value = match maybe {
            Some(m) => Var::Unknown(format!("`${name}` is set {m}")),
            None => {
                let mut items = match (append, self.shell.vars.get(name)) {
                    (true, Some(Var::Array(old))) => Ok(old.clone()),
                    (true, Some(Var::Str(old))) => Ok(vec![old.clone()]),
                    (true, Some(Var::Unknown(why))) => Err(why.clone()),
                    _ => Ok(Vec::new()),
                };
                for r in raw {
                    if let Ok(list) = &mut items {
                        match self.shell.fields(r) {
                            Ok(fs) => list.extend(fs),
                            Err(why) => {
                                items = Err(format!("`${name}`, set on line {line}: {why}"))
                            }
                        }
                    }
                }
                items.map_or_else(Var::Unknown, Var::Array)
            }
        };
        self.shell.vars.insert(name.to_owned(), value);
    }

    /// A test command (`[ ... ]`, `[[ ... ]]`, `test ...`) of strings or integers; `None` for
    /// anything else (files, `&&` inside `[[ ]]`, an expansion not known here).
    fn test(&mut self, words: &[&str]) -> Option<bool> {
        let (first, rest) = words.split_first()?;
        let double = *first == "[[";
        let body = match *first {
            "[" => rest.strip_suffix(&["]"])?,
            "[[" => rest.strip_suffix(&["]]"])?,
            "test" => rest,
            _ => return None,
        };
        let (negate, body) = match body.split_first() {
            Some((&"!", rest)) if double => (true, rest),
            _ => (false, body),
        };
        // an unset variable reads as empty in a test (`[ -z "$X" ]`)
        self.shell.unset_is_empty = true;
        let result = self.test_body(body, double);
        self.shell.unset_is_empty = false;
        Some(result? != negate)
    }

    /// A test's operands expanded (`[[ ]]` splits no word) and evaluated.
    fn test_body(&mut self, body: &[&str], double: bool) -> Option<bool> {
        // `[[ $x == pat* ]]`: the right side is a pattern, but for its quoted parts
        if double && let [l, op @ ("=" | "==" | "!="), r] = body {
            let l: Vec<char> = self.shell.string(l).ok()?.chars().collect();
            let p: Vec<char> = self.shell.pattern(r).ok()?.chars().collect();
            return Some(glob(&p, &l) == (*op != "!="));
        }
        let mut args = Vec::new();
        for raw in body {
            if double {
                args.push(self.shell.string(raw).ok()?);
            } else {
                args.extend(self.shell.fields(raw).ok()?);
            }
        }
        eval_test(&args)
    }
}

fn eval_test(args: &[String]) -> Option<bool> {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let int = |s: &str| s.trim().parse::<i64>().ok();
    Some(match a.as_slice() {
        ["!", rest @ ..] => {
            let rest: Vec<String> = rest.iter().map(|s| s.to_string()).collect();
            !eval_test(&rest)?
        }
        [] => false,
        [s] => !s.is_empty(),
        ["-z", s] => s.is_empty(),
        ["-n", s] => !s.is_empty(),
        [l, "=" | "==", r] => l == r,
        [l, "!=", r] => l != r,
        [l, "<", r] => l < r,
        [l, ">", r] => l > r,
        [l, op @ ("-eq" | "-ne" | "-lt" | "-le" | "-gt" | "-ge"), r] => {
            let (l, r) = (int(l)?, int(r)?);
            match *op {
                "-eq" => l == r,
                "-ne" => l != r,
                "-lt" => l < r,
                "-le" => l <= r,
                "-gt" => l > r,
                _ => l >= r,
            }
        }
        _ => return None,
    })
}

/// An assignment, or an array element's (`a[1]=v`), before a command's words.
fn is_assignment_word(w: &str) -> bool {
    assignment(w).is_some()
        || w.split_once('[')
            .is_some_and(|(n, rest)| is_name(n) && rest.contains("]="))
}

/// `name=value` or `name+=value` as written: (name, append, the value as written).
fn assignment(word: &str) -> Option<(&str, bool, &str)> {
    let (target, raw) = word.split_once('=')?;
    let (name, append) = match target.strip_suffix('+') {
        Some(n) => (n, true),
        None => (target, false),
    };
    is_name(name).then_some((name, append, raw))
}

/// Whether a command's first word looks like one more verl key (`a.b=c`, `+a.b=c`), not a
/// variable's assignment.
fn continues(word: &str) -> bool {
    word.split_once('=').is_some_and(|(k, _)| {
        let k = k.trim_start_matches('+');
        k.contains('.') && k.split('.').all(is_name)
    })
}

fn line_of(items: &[Tok]) -> usize {
    match items.first() {
        Some(Tok::Word(_, l) | Tok::Array { line: l, .. }) => *l,
        _ => 0,
    }
}

#[cfg(test)]
mod tests;
