//! The example configurations in examples/ load and validate as shipped, and
//! the generated completions and man page come out of the real binary.

use std::collections::BTreeMap;

/// The example configuration files, with their text.
fn example_configs() -> Vec<(std::path::PathBuf, String)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "toml"))
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            (path, text)
        })
        .collect();
    found.sort();
    assert!(
        found.len() >= 4,
        "examples for AWS S3, MinIO, R2 and SeaweedFS"
    );
    found
}

#[test]
fn every_example_config_is_valid() {
    for (path, text) in example_configs() {
        waltail::config::Config::from_parts(
            Some(&text),
            &path.display().to_string(),
            &BTreeMap::new(),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

/// The JSON Schema of waltail.toml in schemas/ is what the binary derives
/// from its configuration types, and every example validates against it.
#[test]
fn the_config_schema_is_current_and_every_example_validates() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_waltail"))
        .args(["config", "--schema"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let printed = String::from_utf8(out.stdout).unwrap();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schemas/config.schema.json");
    let stored = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        printed == stored,
        "schemas/config.schema.json is not what the configuration types give; \
         regenerate it: cargo run -- config --schema > schemas/config.schema.json"
    );
    let schema: serde_json::Value = serde_json::from_str(&stored).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    for (path, text) in example_configs() {
        let value: serde_json::Value = toml::from_str(&text).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{}: {errors:?}", path.display());
    }
    // And what it must refuse: an unknown key, a value out of range, a
    // destination type that does not exist.
    let valid =
        |text: &str| validator.is_valid(&toml::from_str::<serde_json::Value>(text).unwrap());
    assert!(valid("[delivery]\nbatch_size = 5\n"));
    assert!(!valid("[delivery]\nbatchsize = 5\n"));
    assert!(!valid("[delivery]\nbatch_size = 0\n"));
    assert!(!valid("[destination]\ntype = \"gcs\"\n"));
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

/// `waltail config` prints the configuration a run would use, with each
/// key's origin and no secret, as a file that loads back to the same.
#[test]
fn config_prints_the_effective_configuration_without_secrets() {
    let bin = env!("CARGO_BIN_EXE_waltail");
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(args).current_dir(dir.path());
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("WALTAIL_")) {
            cmd.env_remove(k);
        }
        let out = cmd.envs(env.iter().copied()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{args:?}: {stderr}");
        String::from_utf8(out.stdout).unwrap()
    };
    let file = dir.path().join("waltail.toml");
    std::fs::write(
        &file,
        "[source]\nurl = \"postgres://app:s3cr3t@db:5432/shop\"\ntables = [\"public.orders\"]\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let printed = run(&["config"], &[("WALTAIL_DELIVERY_BATCH_SIZE", "250")]);
    assert!(!printed.contains("s3cr3t"), "{printed}");
    for line in [
        "url = \"postgres://app:***@db:5432/shop\"  # file",
        "tables = [\"public.orders\"]  # file",
        "batch_size = 250  # WALTAIL_DELIVERY_BATCH_SIZE",
        "pipeline = \"waltail\"  # default",
        "path = \"./waltail-archive\"  # default",
    ] {
        assert!(
            printed.lines().any(|l| l == line),
            "no {line:?} in\n{printed}"
        );
    }
    let again = dir.path().join("printed.toml");
    std::fs::write(&again, &printed).unwrap();
    // It holds a password (hidden, but a password), so it must be private.
    std::fs::set_permissions(&again, std::fs::Permissions::from_mode(0o600)).unwrap();
    let reread = run(&["--config", "printed.toml", "config"], &[]);
    assert!(
        reread.lines().any(|l| l == "batch_size = 250  # file"),
        "{reread}"
    );
    let values = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split("  # ").next().unwrap().to_string())
            .collect()
    };
    assert_eq!(values(&reread), values(&printed));
}
