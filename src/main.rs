//! The `waltail` binary: everything lives in the library; see `cli`.

/// mimalloc instead of glibc's malloc: `compact` allocates and frees
/// millions of small values (cells, keys, rows), and glibc's malloc and
/// free took about a third of its CPU time (perf, 1M changes).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    waltail::cli::main()
}

/// Small pages for the process from its first allocation on, before Rust's
/// runtime starts (see `waltail::cli::small_pages`): the loader runs the
/// functions of `.init_array` before `main`.
#[cfg(target_os = "linux")]
#[used]
#[unsafe(link_section = ".init_array")]
static SMALL_PAGES: extern "C" fn() = {
    extern "C" fn small_pages() {
        waltail::cli::small_pages();
    }
    small_pages
};
