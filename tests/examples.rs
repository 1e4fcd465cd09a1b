//! The example configurations in examples/ load and validate as shipped, and
//! the generated completions and man page come out of the real binary.

use std::collections::BTreeMap;

#[test]
fn every_example_config_is_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            waltail::config::Config::from_parts(
                Some(&text),
                &path.display().to_string(),
                &BTreeMap::new(),
            )
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 4, "examples for AWS S3, MinIO, R2 and SeaweedFS");
}

#[test]
fn completions_and_man_page_are_generated() {
    let bin = env!("CARGO_BIN_EXE_waltail");
    let out = std::process::Command::new(bin)
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("parked") && text.contains("status"), "{text}");
    let out = std::process::Command::new(bin).arg("man").output().unwrap();
    assert!(out.status.success());
    assert!(
        String::from_utf8(out.stdout)
            .unwrap()
            .contains(".TH waltail 1")
    );
}
