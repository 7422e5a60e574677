//! The module map holds. `docs/ARCHITECTURE.md` §2 gives the crate's top-level modules in
//! dependency order (the sentence that begins "Dependency order"): groups joined by `→`. This
//! test reads that order, walks the module tree from `src/lib.rs` as the compiler does, and
//! fails, naming file and line, wherever code names a module of its own group or a later one —
//! through `crate::x`, a `crate::{x, …}` group, a `super::` path that climbs to the crate root, or
//! a name `src/lib.rs` re-exports. Test code may reach anywhere: items and statements under
//! `#[cfg(test)]` (or `#[cfg(all(test, …))]`), and every file of a module declared under one, are
//! skipped, as are comments and literals. It also fails when a module declared in `src/lib.rs`
//! is missing from the order (or the order names one that is not), when a source file is reached
//! by no `mod` declaration, and when the crate root's module map gives another order.
//!
//! No dependency: the scanner is a small tokenizer over the sources, not a Rust parser.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The modules of the order that follows `marker` in `text`, group by group: from the first
/// colon after it to the end of that sentence (a full stop a space or line end follows) or a
/// semicolon. Groups are joined by `→`; a group is the backticked module names between two
/// arrows, outside parentheses (what is in them describes the modules).
fn dependency_order(text: &str, marker: &str) -> Result<Vec<Vec<String>>, String> {
    let start = text
        .find(marker)
        .ok_or_else(|| format!("no {marker:?} to read the dependency order after"))?;
    let text = &text[start..];
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut tick: Option<usize> = None;
    let mut depth = 0i32;
    for (i, c) in text.char_indices() {
        let sentence_end = c == '.' && text[i + 1..].chars().next().is_none_or(char::is_whitespace);
        match c {
            '`' => match tick.take() {
                None => tick = Some(i + 1),
                Some(from) => {
                    let name = &text[from..i];
                    if let Some(group) = groups.last_mut().filter(|_| depth == 0) {
                        if is_identifier(name) {
                            group.push(name.to_string());
                        }
                    }
                }
            },
            _ if tick.is_some() => {}
            '(' => depth += 1,
            ')' => depth -= 1,
            ':' if depth == 0 && groups.is_empty() => groups.push(Vec::new()),
            '→' if depth == 0 && !groups.is_empty() => groups.push(Vec::new()),
            ';' if depth == 0 && !groups.is_empty() => break,
            _ if sentence_end => break,
            _ => {}
        }
    }
    if groups.is_empty() {
        return Err(format!(
            "no colon before the dependency order after {marker:?}"
        ));
    }
    if groups.iter().any(Vec::is_empty) {
        return Err(format!(
            "an empty group in the dependency order after {marker:?}: {groups:?}"
        ));
    }
    Ok(groups)
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    /// A string literal's contents (read for `#[path = "…"]`); other literals leave no token.
    Str(String),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

impl Token {
    fn is_ident(&self, s: &str) -> bool {
        matches!(&self.tok, Tok::Ident(i) if i == s)
    }
    fn is_punct(&self, c: char) -> bool {
        self.tok == Tok::Punct(c)
    }
    fn ident(&self) -> Option<&str> {
        match &self.tok {
            Tok::Ident(i) => Some(i),
            _ => None,
        }
    }
}

/// Rust source as identifiers and punctuation, with comments, char literals and lifetimes
/// dropped and string literals kept as [`Tok::Str`].
fn tokenize(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let count_lines = |from: usize, to: usize, line: &mut usize| {
        *line += c[from..to].iter().filter(|&&ch| ch == '\n').count();
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let (from, mut depth) = (i, 0);
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            count_lines(from, i, &mut line);
        } else if ch == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            out.push(Token {
                tok: Tok::Str(c[i + 1..j].iter().collect()),
                line,
            });
            count_lines(i, j, &mut line);
            i = j + 1;
        } else if ch == '\'' {
            if c.get(i + 1) == Some(&'\\') {
                // An escaped char literal: '\n', '\'', '\u{…}'.
                let mut j = i + 3;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                // A lifetime or a label.
                i += 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
        } else if ident_char(ch) {
            let from = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[from..i].iter().collect();
            let hashes = c[i..].iter().take_while(|&&h| h == '#').count();
            if matches!(word.as_str(), "r" | "br" | "cr") && c.get(i + hashes) == Some(&'"') {
                // A raw string, r#"…"#: it ends at a quote followed by as many hashes.
                let body = i + hashes + 1;
                let mut j = body;
                while j < c.len()
                    && !(c[j] == '"'
                        && c[j + 1..].iter().take_while(|&&h| h == '#').count() >= hashes)
                {
                    j += 1;
                }
                out.push(Token {
                    tok: Tok::Str(c[body..j.min(c.len())].iter().collect()),
                    line,
                });
                count_lines(i, j.min(c.len()), &mut line);
                i = j + 1 + hashes;
            } else {
                out.push(Token {
                    tok: Tok::Ident(word),
                    line,
                });
            }
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
    }
    out
}

/// The index of the token that closes the bracket opened at `open`.
fn closing(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate().skip(open) {
        match t.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
            _ => {}
        }
    }
    tokens.len() - 1
}

/// The last token of the item or statement that starts at `start`: its `;` or its closing `}`.
fn item_end(tokens: &[Token], start: usize) -> usize {
    let mut i = start;
    while i < tokens.len() {
        match tokens[i].tok {
            Tok::Punct(';') => return i,
            Tok::Punct('{') => return closing(tokens, i),
            Tok::Punct('(' | '[') => i = closing(tokens, i) + 1,
            _ => i += 1,
        }
    }
    tokens.len() - 1
}

/// An attribute `#[…]` (or inner `#![…]`) starting at `i`: the index of its `[` and its `]`.
fn attribute_at(tokens: &[Token], i: usize) -> Option<(usize, usize)> {
    if !tokens[i].is_punct('#') {
        return None;
    }
    let open = if tokens.get(i + 1)?.is_punct('!') {
        i + 2
    } else {
        i + 1
    };
    tokens
        .get(open)?
        .is_punct('[')
        .then(|| (open, closing(tokens, open)))
}

/// Whether an attribute's tokens (between its brackets) compile what follows in test builds only:
/// `cfg(test)`, or `cfg(all(…))` with `test` among its terms.
fn is_test_cfg(attr: &[Token]) -> bool {
    match attr {
        [cfg, open, test, close] if cfg.is_ident("cfg") && open.is_punct('(') => {
            test.is_ident("test") && close.is_punct(')')
        }
        [cfg, open, all, terms @ ..] if cfg.is_ident("cfg") && open.is_punct('(') => {
            // `test` among the terms of all(…), at its own depth.
            all.is_ident("all")
                && terms
                    .iter()
                    .scan(0, |depth, t| {
                        *depth += i32::from(t.is_punct('(')) - i32::from(t.is_punct(')'));
                        Some((*depth, t))
                    })
                    .any(|(depth, t)| depth == 1 && t.is_ident("test"))
        }
        _ => false,
    }
}

/// One source file of the crate, tokenized, with its test-only tokens marked.
struct SourceFile {
    /// The path from the crate root, for messages: `src/ops/mod.rs`.
    rel: String,
    /// The module it holds: `["ops"]`, `["vram", "config", "builder"]`; empty for `src/lib.rs`.
    module: Vec<String>,
    tokens: Vec<Token>,
    /// Per token: compiled in test builds only.
    test_only: Vec<bool>,
    /// The `#[path = "…"]` on an item, by the index of the item's first token.
    paths: BTreeMap<usize, String>,
}

/// A `mod x;` a file declares.
struct Declaration {
    name: String,
    /// The inline modules (`mod y { … }`) it is declared in, outermost first.
    within: Vec<String>,
    /// Its `#[path = "…"]`, if any.
    path: Option<String>,
    test_only: bool,
}

impl SourceFile {
    /// Tokenizes `src` and marks what is compiled in test builds only: everything when
    /// `test_only_file` (a file of a test-only module), else each item or statement under a
    /// `#[cfg(test)]`.
    fn parse(rel: String, module: Vec<String>, src: &str, test_only_file: bool) -> Self {
        let tokens = tokenize(src);
        let mut test_only = vec![test_only_file; tokens.len()];
        let mut paths = BTreeMap::new();
        let mut i = 0;
        while i < tokens.len() {
            let Some((open, close)) = attribute_at(&tokens, i) else {
                i += 1;
                continue;
            };
            if open == i + 2 {
                // An inner attribute (`#![…]`) stands on the enclosing module, not on what follows.
                i = close + 1;
                continue;
            }
            // A run of outer attributes, then the item they stand on.
            let (mut test, mut path) = (false, None);
            let mut k = i;
            while let Some((open, close)) = attribute_at(&tokens, k).filter(|&(o, _)| o == k + 1) {
                let attr = &tokens[open + 1..close];
                test |= is_test_cfg(attr);
                if let [name, eq, Token {
                    tok: Tok::Str(p), ..
                }] = attr
                {
                    if name.is_ident("path") && eq.is_punct('=') {
                        path = Some(p.clone());
                    }
                }
                k = close + 1;
            }
            if test && k < tokens.len() {
                let end = item_end(&tokens, k);
                test_only[k..=end].iter_mut().for_each(|t| *t = true);
            }
            if let Some(p) = path {
                paths.insert(k, p);
            }
            i = k;
        }
        SourceFile {
            rel,
            module,
            tokens,
            test_only,
            paths,
        }
    }

    /// The directory this file's `mod x;` declarations are looked up in: its own for `lib.rs` and
    /// `mod.rs`, else one named after it (`vram/config.rs` → `vram/config/`).
    fn module_directory(&self, root: &Path) -> PathBuf {
        let path = root.join(&self.rel);
        let parent = path.parent().expect("a file has a directory");
        if self.rel.ends_with("lib.rs") || self.rel.ends_with("mod.rs") {
            parent.to_path_buf()
        } else {
            parent.join(path.file_stem().expect("a file has a name"))
        }
    }

    /// The out-of-line modules this file declares (`mod x;`).
    fn declarations(&self) -> Vec<Declaration> {
        let t = &self.tokens;
        let mut out = Vec::new();
        let mut inline: Vec<(String, usize)> = Vec::new();
        for i in 0..t.len() {
            while inline.last().is_some_and(|&(_, close)| i > close) {
                inline.pop();
            }
            if !t[i].is_ident("mod") {
                continue;
            }
            let (Some(name), Some(next)) = (t.get(i + 1).and_then(Token::ident), t.get(i + 2))
            else {
                continue;
            };
            if next.is_punct(';') {
                out.push(Declaration {
                    name: name.to_string(),
                    within: inline.iter().map(|(n, _)| n.clone()).collect(),
                    path: self.paths.get(&self.item_start(i)).cloned(),
                    test_only: self.test_only[i],
                });
            } else if next.is_punct('{') {
                inline.push((name.to_string(), closing(t, i + 2)));
            }
        }
        out
    }

    /// The first token of the item whose `mod` keyword is at `m`: its visibility, if any.
    fn item_start(&self, m: usize) -> usize {
        let t = &self.tokens;
        if m >= 1 && t[m - 1].is_ident("pub") {
            return m - 1;
        }
        if m >= 1 && t[m - 1].is_punct(')') {
            if let Some(open) = (0..m - 1).rev().find(|&j| t[j].is_punct('(')) {
                if open >= 1 && t[open - 1].is_ident("pub") {
                    return open - 1;
                }
            }
        }
        m
    }

    /// Every name this file's non-test code reaches through the crate root, with its line:
    /// `crate::x`, each head of `crate::{x, y::z}`, and `super::…` climbing to the root.
    fn root_references(&self) -> Vec<(usize, String)> {
        let t = &self.tokens;
        let colons = |k: usize| {
            t.get(k).is_some_and(|a| a.is_punct(':'))
                && t.get(k + 1).is_some_and(|b| b.is_punct(':'))
        };
        let mut out = Vec::new();
        let mut inline: Vec<usize> = Vec::new();
        for i in 0..t.len() {
            while inline.last().is_some_and(|&close| i > close) {
                inline.pop();
            }
            if t[i].is_ident("mod")
                && t.get(i + 1).and_then(Token::ident).is_some()
                && t.get(i + 2).is_some_and(|n| n.is_punct('{'))
            {
                inline.push(closing(t, i + 2));
            }
            // Only the first segment of a path: `x::crate` is no path to the root.
            if self.test_only[i] || (i >= 2 && colons(i - 2)) {
                continue;
            }
            let root = if t[i].is_ident("crate") && colons(i + 1) {
                i + 3
            } else if t[i].is_ident("super") && colons(i + 1) {
                let mut k = i;
                while t.get(k).is_some_and(|s| s.is_ident("super")) && colons(k + 1) {
                    k += 3;
                }
                if (k - i) / 3 != self.module.len() + inline.len() {
                    continue;
                }
                k
            } else {
                continue;
            };
            match t.get(root) {
                Some(Token {
                    tok: Tok::Ident(name),
                    line,
                }) => out.push((*line, name.clone())),
                Some(open) if open.is_punct('{') => {
                    // The head of each entry of the group: `crate::{a::X, b, self}`.
                    let mut depth = 0;
                    let mut head = true;
                    for tok in &t[root + 1..closing(t, root)] {
                        match &tok.tok {
                            Tok::Punct('{') => depth += 1,
                            Tok::Punct('}') => depth -= 1,
                            Tok::Punct(',') if depth == 0 => head = true,
                            Tok::Ident(name) if head && depth == 0 => {
                                if name != "self" {
                                    out.push((tok.line, name.clone()));
                                }
                                head = false;
                            }
                            _ if depth == 0 => head = false,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }
}

/// Every file of the crate, walked from `src/lib.rs` through its `mod x;` declarations as the
/// compiler finds them (`x.rs` or `x/mod.rs`, or the `#[path]` given).
fn crate_files(root: &Path) -> Vec<SourceFile> {
    let read = |file: &Path, module: Vec<String>, test_only: bool| {
        let src = fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let rel = file
            .strip_prefix(root)
            .unwrap_or(file)
            .to_string_lossy()
            .replace('\\', "/");
        SourceFile::parse(rel, module, &src, test_only)
    };
    let mut files = vec![read(&root.join("src/lib.rs"), Vec::new(), false)];
    let mut next = 0;
    while next < files.len() {
        let f = &files[next];
        let file_test_only =
            f.test_only.first().copied().unwrap_or(false) && f.test_only.iter().all(|&t| t);
        let dir = f.module_directory(root);
        let mut found = Vec::new();
        for d in f.declarations() {
            let base = d.within.iter().fold(
                // A `#[path]` outside inline modules is relative to the declaring file's directory.
                if d.path.is_some() && d.within.is_empty() {
                    root.join(&f.rel)
                        .parent()
                        .expect("a file has a directory")
                        .to_path_buf()
                } else {
                    dir.clone()
                },
                |base, m| base.join(m),
            );
            let file = match &d.path {
                Some(p) => base.join(p),
                None if base.join(format!("{}.rs", d.name)).exists() => {
                    base.join(format!("{}.rs", d.name))
                }
                None => base.join(&d.name).join("mod.rs"),
            };
            assert!(
                file.exists(),
                "{}: declares `mod {};`, but {} is not there",
                f.rel,
                d.name,
                file.display()
            );
            let mut module = f.module.clone();
            module.extend(d.within);
            module.push(d.name);
            found.push((file, module, d.test_only || file_test_only));
        }
        for (file, module, test_only) in found {
            files.push(read(&file, module, test_only));
        }
        next += 1;
    }
    files
}

/// The names `src/lib.rs` re-exports (`pub use loader::{MemoryManager, …}`), each with the
/// top-level module it comes from.
fn root_reexports(lib: &SourceFile) -> BTreeMap<String, String> {
    let t = &lib.tokens;
    let mut out = BTreeMap::new();
    for i in 0..t.len() {
        if !(t[i].is_ident("pub") && t.get(i + 1).is_some_and(|u| u.is_ident("use"))) {
            continue;
        }
        let Some(module) = t.get(i + 2).and_then(Token::ident) else {
            continue;
        };
        let end = item_end(t, i);
        // The last identifier before each `,` / `;` / `}` at the group's depth is a name brought in.
        for w in t[i + 3..=end].windows(2) {
            if let (Some(name), true) = (
                w[0].ident(),
                matches!(w[1].tok, Tok::Punct(',' | ';' | '}')),
            ) {
                out.insert(name.to_string(), module.to_string());
            }
        }
    }
    out
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_names_one_later_in_the_architecture_s_dependency_order() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let architecture =
        fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md");
    let order = dependency_order(&architecture, "Dependency order")
        .unwrap_or_else(|e| panic!("docs/ARCHITECTURE.md §2: {e}"));
    let mut problems = Vec::new();
    // The crate root's module map gives the same order.
    let lib = fs::read_to_string(root.join("src/lib.rs")).expect("src/lib.rs");
    let lib_doc: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    match dependency_order(&lib_doc, "## Module map") {
        Ok(lib_order) if lib_order == order => {}
        Ok(lib_order) => problems.push(format!(
            "src/lib.rs's module map gives another order than docs/ARCHITECTURE.md §2:\n    {lib_order:?}\n    {order:?}"
        )),
        Err(e) => problems.push(format!("src/lib.rs's module map: {e}")),
    }
    let mut position: BTreeMap<&str, usize> = BTreeMap::new();
    for (g, names) in order.iter().enumerate() {
        for name in names {
            if position.insert(name, g).is_some() {
                problems.push(format!("the dependency order names `{name}` twice"));
            }
        }
    }

    let files = crate_files(&root);
    // The walk reaches every source file: one it missed would go unchecked.
    let mut on_disk = Vec::new();
    rust_files(&root.join("src"), &mut on_disk);
    for file in on_disk {
        let rel = file
            .strip_prefix(&root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        if !files.iter().any(|f| f.rel == rel) {
            problems.push(format!(
                "{rel} is not reached from src/lib.rs by any `mod` declaration"
            ));
        }
    }
    let lib = &files[0];
    let modules: Vec<&str> = files
        .iter()
        .filter(|f| f.module.len() == 1)
        .map(|f| f.module[0].as_str())
        .collect();
    for m in &modules {
        if !position.contains_key(m) {
            problems.push(format!(
                "src/lib.rs declares `{m}`, which the dependency order does not name"
            ));
        }
    }
    for name in position.keys() {
        if !modules.contains(name) {
            problems.push(format!(
                "the dependency order names `{name}`, which src/lib.rs does not declare"
            ));
        }
    }

    let reexports = root_reexports(lib);
    for f in &files[1..] {
        let from = f.module[0].as_str();
        let Some(&mine) = position.get(from) else {
            continue;
        };
        for (line, name) in f.root_references() {
            let target = if modules.contains(&name.as_str()) {
                name.clone()
            } else if let Some(m) = reexports.get(&name) {
                m.clone()
            } else {
                problems.push(format!(
                    "{}:{line}: `{from}` names `crate::{name}`, which is neither a module nor a re-export of src/lib.rs",
                    f.rel
                ));
                continue;
            };
            if target == from {
                continue;
            }
            let Some(&theirs) = position.get(target.as_str()) else {
                continue;
            };
            if theirs >= mine {
                let via = if target == name {
                    String::new()
                } else {
                    format!(" (through `crate::{name}`)")
                };
                let relation = if theirs == mine {
                    "in its own group"
                } else {
                    "later"
                };
                problems.push(format!(
                    "{}:{line}: `{from}` names `{target}`{via}, {relation} in the dependency order",
                    f.rel
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the module map in docs/ARCHITECTURE.md §2 does not hold:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_order_is_read_group_by_group() {
    let doc = "Before: `z`. Dependency order (`x.rs`; too): `a`, `b` (on `c`) → `d` (`e`) → `f`, \
               `g`; `h` is not in it.";
    assert_eq!(
        dependency_order(doc, "Dependency order").unwrap(),
        vec![vec!["a", "b"], vec!["d"], vec!["f", "g"]]
    );
    let doc =
        "## Map\n\nIn order (`lib.rs`): [`a`] (about `b`) → [`c`] (see [`d`](c::d)).\n`e`: f.";
    assert_eq!(
        dependency_order(doc, "## Map").unwrap(),
        vec![vec!["a"], vec!["c"]]
    );
    assert!(dependency_order("Dependency order: `a` → → `b`.", "Dependency order").is_err());
}

#[test]
fn the_scanner_reads_code_and_skips_test_code_comments_and_literals() {
    let src = r##"//! Names `crate::doc_comment`.
use crate::a::X;
use crate::{b::Y, self, c::{self, Z}};
/* crate::block /* nested */ crate::still_block */
const S: &str = "crate::string \" crate::escaped";
const R: &str = r#"crate::raw " crate::quoted"#;
fn f<'l>(x: &'l u8) -> char { let _ = super::super::d::Z; '"' }
#[cfg(test)]
mod tests { use crate::test_module; }
#[cfg(test)]
fn helper() { crate::test_fn(); }
#[cfg(all(test, unix))]
use crate::test_and_unix;
#[cfg(not(test))]
use crate::not_test;
pub(crate) fn g() { crate::e::h(); m::crate::not_a_root(); super::n::same_module(); }
mod inline { fn i() { super::super::super::f::J; } }
"##;
    let file = SourceFile::parse(
        "src/m/n.rs".into(),
        vec!["m".into(), "n".into()],
        src,
        false,
    );
    let found = file.root_references();
    let found: Vec<(usize, &str)> = found.iter().map(|(l, n)| (*l, n.as_str())).collect();
    assert_eq!(
        found,
        [
            (2, "a"),
            (3, "b"),
            (3, "c"),
            (7, "d"),
            (15, "not_test"),
            (16, "e"),
            (17, "f")
        ]
    );
    let test_file = SourceFile::parse(
        "src/m/tests.rs".into(),
        vec!["m".into(), "tests".into()],
        src,
        true,
    );
    assert!(test_file.root_references().is_empty());
}
