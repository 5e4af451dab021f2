//! A bash script cut into tokens: words as written (quotes, `$(...)`, `${...}` and backticks
//! kept whole, for [`super::expand`] to expand), array assignments, function heads, and the
//! operators that separate commands. Redirections and here-documents are dropped with their
//! targets and bodies: they never carry a verl key.

use anyhow::Result;

/// A token of a script.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Tok {
    /// A word as written, quotes kept, and its line (1-based).
    Word(String, usize),
    /// `name=(...)` (or `name+=(...)`, `append`): the elements as written.
    Array {
        name: String,
        append: bool,
        items: Vec<String>,
        line: usize,
    },
    /// `name()`: the head of a function definition.
    Func(String, usize),
    /// A newline, `;`, `;;` or `&`: the end of a command.
    Sep,
    /// `&&`.
    And,
    /// `||`.
    Or,
    /// `|` or `|&`.
    Pipe,
    /// `(`: a subshell (or a `case` pattern's closing parenthesis's partner).
    Open,
    /// `)`.
    Close,
}

/// Whether the next token starts a command (nothing, or a separator, before it).
fn at_command_start(toks: &[Tok]) -> bool {
    matches!(
        toks.last(),
        None | Some(Tok::Sep | Tok::And | Tok::Or | Tok::Pipe | Tok::Open | Tok::Close)
    ) || matches!(toks.last(), Some(Tok::Word(w, _)) if matches!(w.as_str(), "then" | "do" | "else" | "{" | "!" | "if" | "elif" | "while" | "until"))
}

/// Whether the tokens so far are inside a `[[ ... ]]` of the current command.
fn in_double_brackets(toks: &[Tok]) -> bool {
    for t in toks.iter().rev() {
        match t {
            Tok::Word(w, _) if w == "]]" => return false,
            Tok::Word(w, _) if w == "[[" => return true,
            Tok::Word(..) => {}
            _ => return false,
        }
    }
    false
}

/// Whether `s` may name a function (bash takes hyphens and dots too).
fn is_function_name(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(|c: char| c.is_ascii_digit())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
        && !matches!(
            s,
            "if" | "then"
                | "elif"
                | "else"
                | "fi"
                | "for"
                | "while"
                | "until"
                | "do"
                | "done"
                | "case"
                | "esac"
                | "function"
                | "{"
                | "}"
        )
}

/// Whether `s` is a shell variable's name.
pub(crate) fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

struct Lexer<'a> {
    chars: Vec<char>,
    i: usize,
    line: usize,
    text: &'a str,
    /// Here-documents whose bodies start after the current line: (delimiter, strip tabs).
    heredocs: Vec<String>,
}

/// The tokens of `text`.
pub(crate) fn lex(text: &str) -> Result<Vec<Tok>> {
    let mut lx = Lexer {
        chars: text.chars().collect(),
        i: 0,
        line: 1,
        text,
        heredocs: Vec::new(),
    };
    let mut toks = Vec::new();
    while let Some(c) = lx.peek(0) {
        match c {
            '\n' => {
                lx.bump();
                toks.push(Tok::Sep);
                lx.skip_heredocs();
            }
            ' ' | '\t' | '\r' => lx.i += 1,
            '\\' if lx.peek(1) == Some('\n') => {
                lx.i += 2;
                lx.line += 1;
            }
            '#' => {
                while lx.peek(0).is_some_and(|c| c != '\n') {
                    lx.i += 1;
                }
            }
            ';' => {
                lx.i += if lx.peek(1) == Some(';') { 2 } else { 1 };
                toks.push(Tok::Sep);
            }
            '&' if lx.peek(1) == Some('&') => {
                lx.i += 2;
                toks.push(Tok::And);
                lx.skip_to_operand();
            }
            '&' if lx.peek(1) == Some('>') => {
                lx.i += 1;
                lx.redirect()?;
            }
            '&' => {
                lx.i += 1;
                toks.push(Tok::Sep);
            }
            '|' if lx.peek(1) == Some('|') => {
                lx.i += 2;
                toks.push(Tok::Or);
                lx.skip_to_operand();
            }
            '|' => {
                lx.i += if lx.peek(1) == Some('&') { 2 } else { 1 };
                toks.push(Tok::Pipe);
                lx.skip_to_operand();
            }
            // `((...))`: an arithmetic command, one word
            '(' if lx.peek(1) == Some('(') && at_command_start(&toks) => {
                let line = lx.line;
                let mut w = String::new();
                lx.i += 1;
                lx.dollar_like(&mut w)?;
                if lx.peek(0) != Some(')') {
                    return Err(lx.fail_at(line, "`((` without its closing `))`"));
                }
                lx.i += 1;
                toks.push(Tok::Word(format!("({w})"), line));
            }
            '(' => {
                lx.i += 1;
                toks.push(Tok::Open);
            }
            ')' => {
                lx.i += 1;
                toks.push(Tok::Close);
            }
            // inside `[[ ]]`, `<` and `>` compare strings
            '<' | '>' if in_double_brackets(&toks) => {
                toks.push(Tok::Word(c.to_string(), lx.line));
                lx.i += 1;
            }
            '<' | '>' => lx.redirect()?,
            _ => {
                let line = lx.line;
                let word = lx.word()?;
                // `2>&1`, `1>log`: a file descriptor's redirection, not a word
                if word.chars().all(|c| c.is_ascii_digit()) && matches!(lx.peek(0), Some('<' | '>'))
                {
                    lx.redirect()?;
                    continue;
                }
                let assign = word.strip_suffix('=').filter(|_| lx.peek(0) == Some('('));
                if let Some(target) = assign {
                    let (name, append) = match target.strip_suffix('+') {
                        Some(n) => (n, true),
                        None => (target, false),
                    };
                    if is_name(name) {
                        lx.i += 1;
                        let items = lx.array_items()?;
                        toks.push(Tok::Array {
                            name: name.to_owned(),
                            append,
                            items,
                            line,
                        });
                        continue;
                    }
                }
                if is_function_name(&word)
                    && lx.after_spaces(0) == Some('(')
                    && at_command_start(&toks)
                {
                    let open = lx.i + lx.chars[lx.i..].iter().position(|c| *c == '(').unwrap_or(0);
                    let after = lx.chars[open + 1..]
                        .iter()
                        .copied()
                        .find(|c| *c != ' ' && *c != '\t');
                    if after == Some(')') {
                        // `name()`, `name ()` or `name ( )`
                        while lx.peek(0) != Some(')') {
                            lx.i += 1;
                        }
                        lx.i += 1;
                        toks.push(Tok::Func(word, line));
                        continue;
                    }
                }
                toks.push(Tok::Word(word, line));
            }
        }
    }
    Ok(toks)
}

impl Lexer<'_> {
    fn peek(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.i + ahead).copied()
    }

    /// The next character after `from` characters and any blanks.
    fn after_spaces(&self, from: usize) -> Option<char> {
        self.chars[(self.i + from).min(self.chars.len())..]
            .iter()
            .copied()
            .find(|c| *c != ' ' && *c != '\t')
    }

    /// Blanks, newlines, continuations and comments (after `&&`, `||` or `|` the command goes
    /// on past them; so does an array's list).
    fn skip_to_operand(&mut self) {
        loop {
            match self.peek(0) {
                Some(' ' | '\t' | '\r' | '\n') => {
                    self.bump();
                }
                Some('\\') if self.peek(1) == Some('\n') => {
                    self.i += 1;
                    self.bump();
                }
                Some('#') => {
                    while self.peek(0).is_some_and(|c| c != '\n') {
                        self.i += 1;
                    }
                }
                _ => return,
            }
        }
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek(0)?;
        self.i += 1;
        if c == '\n' {
            self.line += 1;
        }
        Some(c)
    }

    fn fail(&self, what: &str) -> anyhow::Error {
        self.fail_at(self.line, what)
    }

    fn fail_at(&self, line: usize, what: &str) -> anyhow::Error {
        let text = self.text.lines().nth(line - 1).unwrap_or("").trim();
        anyhow::anyhow!("line {line}: {what}: {text}")
    }

    /// A redirection (`>`, `>>`, `<`, `>&2`, `&>`, `<<EOF`...) and its target, dropped.
    fn redirect(&mut self) -> Result<()> {
        let mut op = String::new();
        while let Some(c) = self
            .peek(0)
            .filter(|c| matches!(c, '<' | '>' | '&' | '|' | '-'))
        {
            // `>&-`, `>&2`: the target is part of the operator
            if c == '-' && !op.ends_with('&') && !op.starts_with("<<") {
                break;
            }
            op.push(c);
            self.i += 1;
            if op == "<<<" {
                break;
            }
        }
        if op.ends_with('&') && self.peek(0).is_some_and(|c| c.is_ascii_digit()) {
            while self.peek(0).is_some_and(|c| c.is_ascii_digit()) {
                self.i += 1;
            }
            return Ok(());
        }
        if op.ends_with("&-") {
            return Ok(());
        }
        while matches!(self.peek(0), Some(' ' | '\t')) {
            self.i += 1;
        }
        if self.peek(0).is_none_or(|c| c == '\n') {
            return Err(self.fail(&format!("`{op}` without a target")));
        }
        let target = self.word()?;
        if op.starts_with("<<") && op != "<<<" {
            let delimiter: String = target
                .chars()
                .filter(|c| !matches!(c, '\'' | '"' | '\\'))
                .collect();
            self.heredocs.push(delimiter);
        }
        Ok(())
    }

    /// After a newline: the bodies of the here-documents the line opened.
    fn skip_heredocs(&mut self) {
        for delimiter in std::mem::take(&mut self.heredocs) {
            loop {
                let start = self.i;
                while self.peek(0).is_some_and(|c| c != '\n') {
                    self.i += 1;
                }
                let line: String = self.chars[start..self.i].iter().collect();
                if self.bump().is_none() || line.trim() == delimiter {
                    break;
                }
            }
        }
    }

    /// `name=(` read: its elements up to the closing `)`.
    fn array_items(&mut self) -> Result<Vec<String>> {
        let mut items = Vec::new();
        loop {
            match self.peek(0) {
                None => return Err(self.fail("an array without its closing `)`")),
                Some(')') => {
                    self.i += 1;
                    return Ok(items);
                }
                Some(' ' | '\t' | '\r' | '\n' | '#') => self.skip_to_operand(),
                Some('\\') if self.peek(1) == Some('\n') => self.skip_to_operand(),
                Some(c) => {
                    let w = self.word()?;
                    if w.is_empty() {
                        return Err(self.fail(&format!("`{c}` inside an array is not read here")));
                    }
                    items.push(w)
                }
            }
        }
    }

    /// A word as written, up to an unquoted blank or operator.
    fn word(&mut self) -> Result<String> {
        let mut w = String::new();
        while let Some(c) = self.peek(0) {
            match c {
                ' ' | '\t' | '\r' | '\n' | ';' | '&' | '|' | '(' | ')' | '<' | '>' => break,
                '\\' => {
                    self.i += 1;
                    match self.bump() {
                        Some('\n') => {}
                        Some(n) => {
                            w.push('\\');
                            w.push(n);
                        }
                        None => w.push('\\'),
                    }
                }
                '\'' => self.single_quoted(&mut w)?,
                '"' => self.double_quoted(&mut w)?,
                '`' => self.backticks(&mut w)?,
                '$' => self.dollar(&mut w)?,
                _ => {
                    w.push(c);
                    self.i += 1;
                }
            }
        }
        Ok(w)
    }

    fn single_quoted(&mut self, w: &mut String) -> Result<()> {
        let start = self.line;
        w.push('\'');
        self.i += 1;
        loop {
            match self.bump() {
                None => return Err(self.fail_at(start, "an unclosed quote")),
                Some('\'') => break,
                Some(c) => w.push(c),
            }
        }
        w.push('\'');
        Ok(())
    }

    fn double_quoted(&mut self, w: &mut String) -> Result<()> {
        let start = self.line;
        w.push('"');
        self.i += 1;
        loop {
            match self.peek(0) {
                None => return Err(self.fail_at(start, "an unclosed quote")),
                Some('"') => {
                    self.i += 1;
                    break;
                }
                Some('\\') => self.escaped(w),
                Some('$') => self.dollar(w)?,
                Some('`') => self.backticks(w)?,
                Some(_) => w.push(self.bump().unwrap_or_default()),
            }
        }
        w.push('"');
        Ok(())
    }

    fn backticks(&mut self, w: &mut String) -> Result<()> {
        w.push('`');
        self.i += 1;
        loop {
            match self.peek(0) {
                None => return Err(self.fail("an unclosed backtick")),
                Some('`') => {
                    self.i += 1;
                    break;
                }
                Some('\\') => self.escaped(w),
                Some(_) => w.push(self.bump().unwrap_or_default()),
            }
        }
        w.push('`');
        Ok(())
    }

    /// A backslash and the character it escapes, kept as written.
    fn escaped(&mut self, w: &mut String) {
        self.i += 1;
        w.push('\\');
        if let Some(c) = self.bump() {
            w.push(c);
        }
    }

    /// `$`, and whatever it opens: `$(...)`, `$((...))`, `${...}` read whole.
    fn dollar(&mut self, w: &mut String) -> Result<()> {
        w.push('$');
        self.i += 1;
        self.dollar_like(w)
    }

    /// What a `$` opens, from the bracket at the current position (none: nothing).
    fn dollar_like(&mut self, w: &mut String) -> Result<()> {
        let (open, close) = match self.peek(0) {
            Some('(') => ('(', ')'),
            Some('{') => ('{', '}'),
            _ => return Ok(()),
        };
        w.push(open);
        self.i += 1;
        let mut depth = 1;
        while depth > 0 {
            match self.peek(0) {
                None => return Err(self.fail(&format!("an unclosed `${open}`"))),
                Some('\'') => self.single_quoted(w)?,
                Some('"') => self.double_quoted(w)?,
                Some('\\') => self.escaped(w),
                Some('$') => self.dollar(w)?,
                Some(c) => {
                    if c == open {
                        depth += 1;
                    } else if c == close {
                        depth -= 1;
                    }
                    w.push(c);
                    self.bump();
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<String> {
        lex(text)
            .unwrap()
            .into_iter()
            .filter_map(|t| match t {
                Tok::Word(w, _) => Some(w),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn words_keep_their_quotes_and_expansions_whole() {
        assert_eq!(
            words("a=\"x y\" 'p q' $((1 + 2)) $(date +%F) ${x:-a b} `pwd` b\\ c # note\n"),
            [
                "a=\"x y\"",
                "'p q'",
                "$((1 + 2))",
                "$(date +%F)",
                "${x:-a b}",
                "`pwd`",
                "b\\ c"
            ]
        );
        // continuations join lines; redirections and here-documents are dropped
        assert_eq!(
            words(
                "python3 -m x \\\n  k=v 2>&1 > \"$LOG\" | tee log\ncat <<EOF\nk=inside\nEOF\nafter"
            ),
            ["python3", "-m", "x", "k=v", "tee", "log", "cat", "after"]
        );
    }

    #[test]
    fn arrays_functions_and_operators_are_tokens() {
        let toks = lex("A=(\n  x=1 # one\n  \"y=2\"\n)\nB+=(z)\nf() { echo; }\na && b || c; (d)\n")
            .unwrap();
        assert_eq!(
            toks[0],
            Tok::Array {
                name: "A".into(),
                append: false,
                items: vec!["x=1".into(), "\"y=2\"".into()],
                line: 1
            }
        );
        assert!(matches!(&toks[2], Tok::Array { name, append: true, .. } if name == "B"));
        assert!(toks.contains(&Tok::Func("f".into(), 6)));
        for t in [Tok::And, Tok::Or, Tok::Open, Tok::Close] {
            assert!(toks.contains(&t), "{t:?} in {toks:?}");
        }
    }

    #[test]
    fn an_unclosed_quote_names_its_line() {
        let err = lex("a=1\nb=\"open\n").unwrap_err().to_string();
        assert!(err.contains("line 2: an unclosed quote: b=\"open"), "{err}");
    }
}
