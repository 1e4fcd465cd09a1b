//! The `waltail` binary: everything lives in the library; see `cli`.

/// mimalloc instead of glibc's malloc: `compact` allocates and frees
/// millions of small values (cells, keys, rows), and glibc's malloc and
/// free took about a third of its CPU time (perf, 1M changes).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    waltail::cli::main()
}
