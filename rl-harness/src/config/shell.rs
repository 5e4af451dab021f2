//! A verl launch script read as bash runs it with no arguments, as far as its verl command:
//! the variables it sets (plain, `export`ed, arrays, `${x:-default}`, `$((...))`), the
//! `if`/`elif`/`else` branches whose conditions are tests of strings and numbers, and the
//! arguments of the first command that runs verl's entry point, expanded. Nothing is executed:
//! another command's output, a branch whose condition is not a test, a loop or `case`, a
//! function's body, or a file the script `source`s is not followed, and a variable that depends
//! on one is reported as unknown with the reason, never guessed.

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
    Brace,
    Subshell,
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
            Tok::Open => r.frames.push(Frame::Subshell),
            Tok::Close => {
                if matches!(r.frames.last(), Some(Frame::Subshell)) {
                    r.frames.pop();
                }
            }
            _ => {}
        }
        join = next;
    }
    Ok(r.command(cmd, join))
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
                Frame::If { .. } | Frame::Brace | Frame::Subshell => Branch::Run,
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

    /// Reads one command; the launch if it is verl's.
    fn command(&mut self, items: Vec<Tok>, join: Join) -> Option<Launch> {
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
                    let words: Vec<(String, usize)> = items
                        .by_ref()
                        .take_while(|i| !matches!(i, Tok::Word(w, _) if w == "then"))
                        .filter_map(|i| match i {
                            Tok::Word(w, l) => Some((w, l)),
                            _ => None,
                        })
                        .collect();
                    let text = words.iter().map(|(w, _)| w.as_str()).collect::<Vec<_>>();
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
                        _ => self.frames.push(Frame::Brace),
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
        let joined = match (join, self.status) {
            (Join::And, Some(false)) | (Join::Or, Some(true)) => Branch::Skip,
            (Join::And | Join::Or, None) => Branch::Maybe(format!(
                "after `&&` or `||` on line {}, following a command whose success is not known here",
                line_of(&items)
            )),
            _ => Branch::Run,
        };
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
        let status = self.run(items, maybe);
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
        for item in items {
            match item {
                Tok::Array {
                    name,
                    append,
                    items,
                    line,
                } => self.assign_array(&name, append, &items, line, &maybe),
                Tok::Word(w, line) if words.is_empty() && assignment(&w).is_some() => {
                    self.assign(&w, line, &maybe)
                }
                Tok::Word(w, line) => words.push((w, line)),
                // a command holds only words and array assignments
                _ => {}
            }
        }
        let Some((first, line)) = words.first().cloned() else {
            return Ok(Some(true));
        };
        // verl's entry point, anywhere in the command (`python3 -m X`, `torchrun ... -m X`);
        // not in a function's definition, which runs only where it is called
        let defining = self.frames.iter().any(|f| matches!(f, Frame::Func { .. }));
        for (k, (w, _)) in words.iter().enumerate().filter(|_| !defining) {
            let Ok(fields) = self.shell.fields(w) else {
                continue;
            };
            if let Some(at) = fields.iter().position(|f| (self.is_entry)(f)) {
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
                return Err(Launch {
                    args,
                    entry: fields[at].clone(),
                    conditional: maybe,
                    cut: None,
                });
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
            "true" | ":" | "echo" | "printf" | "mkdir" | "set" | "shopt" | "ulimit" | "trap"
            | "shift" | "ray" | "nvidia-smi" | "pip" | "pip3" | "sleep" | "wait" => Some(true),
            "false" => Some(false),
            _ => None,
        })
    }

    fn assign(&mut self, word: &str, line: usize, maybe: &Option<String>) {
        let Some((name, append, raw)) = assignment(word) else {
            return;
        };
        let value = match maybe {
            Some(m) => Var::Unknown(format!("`${name}` is set {m}")),
            None => match self.shell.string(raw) {
                Ok(v) => match (append, self.shell.vars.get(name)) {
                    (true, Some(Var::Str(old))) => Var::Str(format!("{old}{v}")),
                    (true, Some(Var::Unknown(why))) => Var::Unknown(why.clone()),
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
        let mut args = Vec::new();
        self.shell.unset_is_empty = true;
        let expanded: Result<(), String> = body.iter().try_for_each(|raw| {
            if double {
                args.push(self.shell.string(raw)?);
            } else {
                args.extend(self.shell.fields(raw)?);
            }
            Ok(())
        });
        self.shell.unset_is_empty = false;
        expanded.ok()?;
        // `[[ $x == pat* ]]`: an unquoted right side is a glob
        let pattern = double && body.len() == 3 && !body[2].contains(['"', '\'']);
        eval_test(&args, pattern)
    }
}

fn eval_test(args: &[String], pattern: bool) -> Option<bool> {
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let int = |s: &str| s.trim().parse::<i64>().ok();
    Some(match a.as_slice() {
        ["!", rest @ ..] => {
            let rest: Vec<String> = rest.iter().map(|s| s.to_string()).collect();
            !eval_test(&rest, pattern)?
        }
        [] => false,
        [s] => !s.is_empty(),
        ["-z", s] => s.is_empty(),
        ["-n", s] => !s.is_empty(),
        [l, "=" | "==", r] if pattern => glob(
            &r.chars().collect::<Vec<_>>(),
            &l.chars().collect::<Vec<_>>(),
        ),
        [l, "!=", r] if pattern => !glob(
            &r.chars().collect::<Vec<_>>(),
            &l.chars().collect::<Vec<_>>(),
        ),
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
