//! Links the `waltail` binary as a position-dependent executable on Linux.
//!
//! A position-independent executable (the toolchain's default) is relocated
//! by the dynamic loader at every start: about 270,000 relocations, each
//! page it writes copied, 1,400 page faults and 4-5 ms before `main`, on a
//! `waltail query` that answers in 15-25 ms. Linked at a fixed address the
//! binary starts in about 2 ms (`perf stat -r 30 waltail --version`). What
//! is given up is the randomised address of the binary's own code; its
//! heap, stack and shared libraries stay randomised.
//!
//! Only the package's binaries are linked so (`rustc-link-arg-bins`): test
//! binaries, build scripts and proc-macros keep the default.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux");
    // `WALTAIL_PIE=1` at build time keeps the default, for a policy that
    // requires position-independent executables.
    println!("cargo:rerun-if-env-changed=WALTAIL_PIE");
    let pie = std::env::var("WALTAIL_PIE").is_ok_and(|v| v == "1");
    if linux && !pie {
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
}
