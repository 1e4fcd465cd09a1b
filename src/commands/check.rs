//! `waltail check`: every check of the source (`source::check`) and a write
//! to the destination, each printed with its fix; creates nothing. Exit 0
//! only when nothing failed.

use std::process::ExitCode;

use crate::Result;
use crate::config::Config;
use crate::error::Report;
use crate::sink::Sink;
use crate::source::check::{self, Finding, Status};

pub(crate) async fn check(config: &Config) -> Result<ExitCode> {
    println!("source       {}", crate::source::describe(&config.source));
    let mut findings = check::run(&config.source).await;
    print_findings(&findings);
    println!("destination  {}", config.destination.describe());
    let dest = destination_check(config).await;
    print_findings(std::slice::from_ref(&dest));
    findings.push(dest);
    let failed = findings.iter().filter(|f| f.status == Status::Fail).count();
    if failed == 0 {
        println!("all checks passed");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{failed} check(s) failed");
        Ok(ExitCode::FAILURE)
    }
}

async fn destination_check(config: &Config) -> Finding {
    let result: Result<String> = async {
        let sink = Sink::new(&config.destination, config.delivery.request_timeout)?;
        sink.check(&config.pipeline).await
    }
    .await;
    match result {
        Ok(key) => Finding {
            status: Status::Pass,
            name: "write access".into(),
            detail: format!("wrote {key}"),
            fix: None,
        },
        Err(e) => Finding {
            status: Status::Fail,
            name: "write access".into(),
            detail: Report(&e).to_string(),
            fix: Some(e.hint().unwrap_or_else(|| {
                "check the destination settings and that the store is reachable".into()
            })),
        },
    }
}

fn print_findings(findings: &[Finding]) {
    for f in findings {
        let mark = match f.status {
            Status::Pass => "ok    ",
            Status::Warn => "WARN  ",
            Status::Advice => "note  ",
            Status::Fail => "FAIL  ",
        };
        println!("  {mark}{:<26} {}", f.name, f.detail);
        if let Some(fix) = &f.fix {
            println!("        {:<26} fix: {fix}", "");
        }
    }
}
