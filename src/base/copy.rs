//! Memory copies for paths that move bytes with the CPU (SHM, the simulated device).
//!
//! A large transfer is copied in chunks of at most a few MiB, each with its own call. `memcpy`
//! picks cache-bypassing (non-temporal) stores only for a single call larger than a good part
//! of the last-level cache, so chunk by chunk it writes through the cache: every destination
//! line is first read from memory, then written back later, and the copy runs at about 60% of
//! the one-call speed (measured here: 1 MiB chunks 7.4-8.6 GB/s, the same bytes in one call
//! 12-13 GB/s, with non-temporal stores 13-15 GB/s). A transport that knows it moves more than
//! fits in the cache asks for [`copy`] with `streaming`, which uses non-temporal stores for the
//! aligned middle of the range; what it wrote is visible to other threads and processes once
//! the call returns (it ends with a store fence).

/// Copies `len` bytes from `src` to `dst` (the ranges may overlap). With `streaming`, and where
/// the CPU has them (x86-64), non-temporal stores write the destination without reading it into
/// the cache first; without it, or for overlapping ranges, this is `memmove`.
///
/// # Safety
/// `[src, src+len)` must be valid for reads and `[dst, dst+len)` for writes for the whole call.
pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        let overlap =
            (src as usize) < (dst as usize).wrapping_add(len) && (dst as usize) < (src as usize).wrapping_add(len);
        if streaming && !overlap && len >= STREAM_MIN {
            // SAFETY: forwarded from this function's contract; the ranges do not overlap.
            unsafe { x86::stream_copy(src, dst, len) };
            return;
        }
    }
    let _ = streaming;
    // SAFETY: forwarded from this function's contract.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// Below this size a copy is too short for non-temporal stores to pay off.
const STREAM_MIN: usize = 4096;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// Bytes per loop iteration: four 16-byte stores.
    const STEP: usize = 64;

    /// Copies with non-temporal 16-byte stores (SSE2, part of every x86-64 CPU) for the part of
    /// the destination that is 16-byte aligned, plain copies for the ends, then a store fence.
    ///
    /// # Safety
    /// As [`super::copy`], and the ranges must not overlap.
    pub unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
        let head = dst.align_offset(16).min(len);
        // SAFETY: head <= len, inside both ranges, which do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) / STEP * STEP;
        let mut i = head;
        while i < head + body {
            // SAFETY: i + STEP <= len, so every load and store stays inside the ranges; `dst + i`
            // is 16-byte aligned (head made it so and STEP is a multiple of 16), as the stream
            // stores require; unaligned loads have no alignment requirement.
            unsafe {
                let s = src.add(i).cast::<__m128i>();
                let d = dst.add(i).cast::<__m128i>();
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            i += STEP;
        }
        // SAFETY: the rest of the range, after the aligned body.
        unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
        // Non-temporal stores are weakly ordered: fence them before anyone is told the copy is
        // done (the caller publishes completion with a release store after this).
        // SAFETY: a fence has no preconditions.
        unsafe { _mm_sfence() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_every_byte_at_any_alignment_and_size() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 31 % 251) as u8).collect();
        for &len in &[0usize, 1, 15, 16, 63, 64, 65, 4095, 4096, 4097, 10_000, 65_536] {
            for s_off in [0usize, 1, 7, 16] {
                for d_off in [0usize, 3, 8, 16, 33] {
                    let mut dst = vec![0xeeu8; len + d_off + 40];
                    // SAFETY: both ranges are inside their vectors.
                    unsafe { copy(src.as_ptr().add(s_off), dst.as_mut_ptr().add(d_off), len, true) };
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "len {len} at {s_off}->{d_off}");
                    assert!(dst[..d_off].iter().all(|&b| b == 0xee), "nothing written before");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xee), "nothing written after");
                }
            }
        }
    }

    #[test]
    fn overlapping_ranges_are_moved_as_memmove_does() {
        let mut v: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
        let expect: Vec<u8> = v[0..16_000].to_vec();
        // SAFETY: both ranges are inside `v`.
        unsafe { copy(v.as_ptr(), v.as_mut_ptr().add(100), 16_000, true) };
        assert_eq!(&v[100..16_100], &expect[..]);
    }
}
