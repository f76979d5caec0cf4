//! Cache prefetch hints: asking the CPU to start loading lines that are about to be read or
//! written, so that the misses of several lookups or copies overlap instead of coming one by
//! one. Hints only: they read nothing architecturally and never fault, whatever the address;
//! off x86-64 they do nothing.

/// Starts loading the cache line holding `p` for reading.
pub fn read_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch has no preconditions and cannot fault; SSE, which it needs, is part of
    // every x86-64 CPU.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Starts loading the cache line holding `p` for writing (owned, so the store that follows
/// does not wait for other cores' copies to be invalidated).
pub fn write_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `read_line`.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_ET0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_ET0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Starts loading every cache line of `items` for reading.
pub fn lines<T>(items: &[T]) {
    let (start, bytes) = (items.as_ptr() as usize, std::mem::size_of_val(items));
    for line in (start & !63..start + bytes).step_by(64) {
        read_line(line as *const u8);
    }
}
