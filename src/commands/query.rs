//! `waltail query`: the SQL from the argument, a file or stdin, or a prompt
//! on a terminal; results as a table on a terminal, CSV otherwise.

use std::io::IsTerminal;
use std::process::ExitCode;

use crate::config::Config;
use crate::query::output::Format;
use crate::query::{Options, Query};
use crate::{Error, Result};

/// Runs `waltail query`.
pub(crate) async fn query(config: &Config, opts: &Options) -> Result<ExitCode> {
    let format = opts.format.unwrap_or(if std::io::stdout().is_terminal() {
        Format::Table
    } else {
        Format::Csv
    });
    let sql =
        match (&opts.file, opts.sql.as_deref()) {
            (Some(path), _) if path.as_os_str() == "-" => Some(read_stdin()?),
            (Some(path), _) => Some(std::fs::read_to_string(path).map_err(|e| {
                Error::io(format!("cannot read the SQL file {}", path.display()), e)
            })?),
            (None, Some("-")) => Some(read_stdin()?),
            (None, Some(sql)) => Some(sql.to_string()),
            (None, None) if std::io::stdin().is_terminal() => None,
            (None, None) => Some(read_stdin()?),
        };
    let query = Query::new(
        config,
        opts.at.clone(),
        format,
        opts.timing,
        opts.keep_decoded_mib.saturating_mul(1 << 20),
    )?;
    match sql {
        Some(sql) => {
            query.run(&sql).await?;
            Ok(ExitCode::SUCCESS)
        }
        None => query.prompt().await,
    }
}

fn read_stdin() -> Result<String> {
    let mut sql = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut sql)
        .map_err(|e| Error::io("cannot read the SQL from stdin", e))?;
    Ok(sql)
}
