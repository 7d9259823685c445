//! A bounded, uniform sample of a run's measurements, so that a coordinator's memory does not
//! grow with the number of steps or commands (a job may run for 100,000 steps).
//!
//! Reservoir sampling (Vitter's algorithm R): every value is kept while there are at most
//! [`RESERVOIR_CAP`]; after that the `n`-th value replaces a kept one with probability
//! `cap / n`, so every value seen has the same chance to be in the sample and its percentiles
//! estimate the whole run's. Up to the cap they are exact. The random choices come from a fixed
//! seed: the same values give the same sample.

use serde::Serialize;

/// Values kept at most.
pub const RESERVOIR_CAP: usize = 16_384;

/// A bounded uniform sample of the values pushed into it; it reads as the slice of the values
/// kept (`&reservoir[..]`, `reservoir.len()`), in the order they were kept.
#[derive(Clone, Debug)]
pub struct Reservoir<T> {
    values: Vec<T>,
    seen: u64,
    cap: usize,
    rng: u64,
}

impl<T> Default for Reservoir<T> {
    fn default() -> Self {
        Reservoir::with_cap(RESERVOIR_CAP)
    }
}

impl<T> Reservoir<T> {
    /// A reservoir keeping at most `cap` values (at least one).
    pub fn with_cap(cap: usize) -> Reservoir<T> {
        Reservoir { values: Vec::new(), seen: 0, cap: cap.max(1), rng: 0x9e37_79b9_7f4a_7c15 }
    }

    /// Offers one value.
    pub fn push(&mut self, value: T) {
        self.seen += 1;
        if self.values.len() < self.cap {
            self.values.push(value);
            return;
        }
        let slot = self.next_random() % self.seen;
        if let Some(kept) = self.values.get_mut(slot as usize) {
            *kept = value;
        }
    }

    /// How many values were offered (kept or not).
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// xorshift64*: enough for choosing slots, and deterministic.
    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

impl<T> std::ops::Deref for Reservoir<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.values
    }
}

impl<T: Serialize> Serialize for Reservoir<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.values.serialize(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_everything_up_to_the_cap_then_a_uniform_sample() {
        let mut r = Reservoir::with_cap(1000);
        for v in 0..1000u32 {
            r.push(v);
        }
        assert_eq!(r.len(), 1000);
        assert!(r.iter().copied().eq(0..1000), "every value, in order, up to the cap");
        for v in 1000..100_000u32 {
            r.push(v);
        }
        assert_eq!((r.len(), r.seen()), (1000, 100_000));
        // Uniform: the kept values' median is near the run's (50,000), and every decile is
        // represented.
        let mut kept: Vec<u32> = r.to_vec();
        kept.sort();
        let median = kept[kept.len() / 2];
        assert!((45_000..55_000).contains(&median), "median {median}");
        for decile in 0..10 {
            let n = kept.iter().filter(|&&v| v / 10_000 == decile).count();
            assert!((60..140).contains(&n), "decile {decile}: {n} of 1000");
        }
    }
}
