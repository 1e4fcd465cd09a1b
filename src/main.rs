//! The `waltail` binary: everything lives in the library; see `cli`.

fn main() -> std::process::ExitCode {
    waltail::cli::main()
}
