//! Asking the processor for memory a few steps before it is read.
//!
//! Two of a query's loops read memory in an order the cache cannot guess:
//! the key window compares keys the sort scattered (see `window`), and the
//! rebuild of the latest view at a seq looks every change's key up in a
//! table far larger than the cache (see `at`). Each asks for what it will
//! read some steps ahead, so the misses overlap instead of following one
//! another.

/// Asks the processor to bring the cache line at `at` into its cache. A
/// prefetch reads nothing the program sees and cannot fault, whatever the
/// pointer; on other processors it does nothing.
#[inline]
pub(crate) fn prefetch<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is a hint: it never faults and has no effect
    // the program can observe.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}
