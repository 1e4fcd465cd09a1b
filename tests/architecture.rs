//! The crate's modules form layers: no module imports one that imports it,
//! at any depth, among the top-level modules of `src/` or among the
//! submodules of any folder module (`compact/`, `source/`, ...).
//!
//! Read from the source text: every `crate::a::b`, `super::b` and
//! `self::b` path of a file, outside comments and before its `#[cfg(test)]`
//! test module (tests may reach anywhere; by the house style that module
//! ends the file). A cycle fails the test with its modules and the
//! paths that close it, so the fix can start at the named line.
//!
//! And no file is longer than a reader holds at once (see
//! [`MAX_LINES`]) unless its opening comment says why it must be one file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's place: its path from the crate root, e.g. `["compact", "read"]`.
type Module = Vec<String>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/compact/read.rs` -> `compact::read`; `src/compact/mod.rs` -> `compact`.
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts
        .last()
        .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
    {
        parts.pop();
    }
    parts
}

/// A file without its test module (by the house style, the file's end).
fn without_tests(text: &str) -> &str {
    let cut = [
        "#[cfg(test)]\nmod tests {",
        "#[cfg(test)]\npub(crate) mod tests {",
    ]
    .iter()
    .filter_map(|m| text.find(m))
    .min();
    &text[..cut.unwrap_or(text.len())]
}

/// The code of a file without its tests and comments.
fn code(text: &str) -> String {
    without_tests(text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every module path a file's code names: `crate::a::b::Item` gives
/// `a::b::Item` (cut to a depth later), `super::x` the parent's `x`,
/// `self::x` the module's own `x`, and a `use crate::{a, b::c, Error}`
/// group each of its members (`Error` and `Result` are the `error`
/// module's, re-exported at the root).
fn references(module: &Module, code: &str) -> Vec<Module> {
    let ident = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    let path_after = |text: &str| -> Module {
        let name: String = text.chars().take_while(|&c| ident(c)).collect();
        name.split("::").map(str::to_string).collect()
    };
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for member in group[..end].split(',') {
                let path = path_after(member.trim());
                match path.first().map(String::as_str) {
                    Some("Error" | "Result") => out.push(vec!["error".into()]),
                    Some(first) if first.starts_with(|c: char| c.is_lowercase()) => out.push(path),
                    _ => {}
                }
            }
        } else {
            out.push(path_after(after));
        }
        rest = after;
    }
    let parent = &module[..module.len().saturating_sub(1)];
    for (word, base) in [("super::", parent), ("self::", &module[..])] {
        let mut rest = code;
        while let Some(i) = rest.find(word) {
            let after = &rest[i + word.len()..];
            // `crate::x::self::` or `super::super::`: not a path from here.
            let before = rest[..i].chars().last();
            if !before.is_some_and(|c| c == ':' || c.is_alphanumeric() || c == '_') {
                let mut full = base.to_vec();
                full.extend(path_after(after));
                out.push(full);
            }
            rest = after;
        }
    }
    out
}

/// The import graph among the modules directly inside `within` (the crate
/// root when empty): an edge from each to the siblings its code (or its
/// submodules' code) names.
fn graph(
    files: &[(Module, bool, String)],
    within: &[String],
    known: &BTreeSet<Module>,
) -> BTreeMap<String, BTreeMap<String, String>> {
    let depth = within.len() + 1;
    let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (module, _, code) in files {
        if module.len() < depth || module[..within.len()] != *within {
            continue;
        }
        let from = module[within.len()].clone();
        for path in references(module, code) {
            if path.len() < depth || path[..within.len()] != *within {
                continue;
            }
            let to = path[within.len()].clone();
            let target: Module = path[..depth].to_vec();
            if to != from && known.contains(&target) {
                edges
                    .entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_insert_with(|| format!("{}: {}", module.join("::"), path.join("::")));
            }
        }
    }
    edges
}

/// A cycle of `edges`, if any, as its modules in order.
fn cycle(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeMap<String, String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_string(), 1);
        stack.push(node.to_string());
        for next in edges.get(node).into_iter().flat_map(|m| m.keys()) {
            match state.get(next.as_str()) {
                Some(1) => {
                    let start = stack.iter().position(|n| n == next).unwrap();
                    let mut found = stack[start..].to_vec();
                    found.push(next.clone());
                    return Some(found);
                }
                Some(_) => {}
                None => {
                    if let Some(found) = visit(next, edges, state, stack) {
                        return Some(found);
                    }
                }
            }
        }
        stack.pop();
        state.insert(node.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        if !state.contains_key(node.as_str())
            && let Some(found) = visit(node, edges, &mut state, &mut Vec::new())
        {
            return Some(found);
        }
    }
    None
}

#[test]
fn no_module_imports_one_that_imports_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    let files: Vec<(Module, bool, String)> = paths
        .iter()
        .map(|p| {
            let is_dir = p.file_name().is_some_and(|n| n == "mod.rs");
            (
                module_of(&src, p),
                is_dir,
                code(&std::fs::read_to_string(p).unwrap()),
            )
        })
        .collect();
    let known: BTreeSet<Module> = files
        .iter()
        .flat_map(|(m, _, _)| (1..=m.len()).map(|n| m[..n].to_vec()))
        .collect();
    // The crate root, then every folder module.
    let mut scopes: Vec<Module> = vec![Vec::new()];
    scopes.extend(
        files
            .iter()
            .filter(|(_, is_dir, _)| *is_dir)
            .map(|(m, _, _)| m.clone()),
    );
    assert!(scopes.len() > 5, "src/ was not read: {scopes:?}");
    let mut checked = 0;
    for within in &scopes {
        let edges = graph(&files, within, &known);
        checked += edges.values().map(BTreeMap::len).sum::<usize>();
        if let Some(found) = cycle(&edges) {
            let closing: Vec<String> = found
                .windows(2)
                .map(|w| format!("  {} -> {}: {}", w[0], w[1], edges[&w[0]][&w[1]]))
                .collect();
            panic!(
                "an import cycle in {}: {}\n{}",
                if within.is_empty() {
                    "src/".to_string()
                } else {
                    format!("src/{}/", within.join("/"))
                },
                found.join(" -> "),
                closing.join("\n")
            );
        }
    }
    // The graph was read: the crate's modules import one another.
    assert!(checked > 50, "only {checked} imports found");
}

/// The most lines (not blank, comments included, tests left out) a file
/// of `src/` has: about what a reader holds at once. A longer file holds
/// more than one concept, or one that needs parts of its own.
const MAX_LINES: usize = 600;

#[test]
fn no_file_is_longer_than_a_reader_holds_unless_it_says_why() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    assert!(paths.len() > 50, "src/ was not read: {paths:?}");
    let mut long: Vec<String> = paths
        .iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            let lines = without_tests(&text)
                .lines()
                .filter(|l| !l.trim().is_empty())
                .count();
            // A file that must be one (a decoder's single match) says so
            // where a reader starts.
            let opening: String = text
                .lines()
                .take_while(|l| l.starts_with("//!"))
                .collect::<Vec<_>>()
                .join(" ");
            (lines > MAX_LINES && !opening.contains("one file")).then(|| {
                format!(
                    "  {} ({lines} lines)",
                    p.strip_prefix(&src).unwrap().display()
                )
            })
        })
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines of non-test code: split each along its concepts, or say in its opening comment why it must be one file\n{}",
        long.join("\n")
    );
}
