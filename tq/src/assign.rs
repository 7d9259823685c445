//! Token-balanced assignment of a step's samples to data-parallel shards.
//!
//! A shard's step time follows its token count, not its sample count (attention and MLP cost grow
//! with tokens), so the coordinator balances tokens: longest-first greedy (LPT) puts each sample,
//! longest first, on the shard with the fewest tokens so far. LPT's makespan is within 4/3 of the
//! optimum, and in practice within one sample's length of the mean. Ties go to the lowest shard,
//! and equal lengths keep their input order, so the result is deterministic.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The samples of each shard and how balanced they are.
#[derive(Clone, Debug, PartialEq)]
pub struct Assignment {
    /// Per shard: indices into the input, in input order.
    pub shards: Vec<Vec<usize>>,
    /// Per shard: total tokens.
    pub tokens: Vec<u64>,
    /// max / mean tokens over shards (1.0 is perfect; 1.0 when there are no tokens at all).
    pub imbalance: f64,
}

/// Errors of [`assign`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignError {
    /// No shards to assign to.
    #[error("cannot assign samples to 0 data-parallel shards; the trainer's parallelism.data must be at least 1")]
    NoShards,
}

/// Assigns samples (given by their token counts) to `shards` shards, longest first, each to the
/// shard with the fewest tokens so far.
pub fn assign(tokens: &[u32], shards: usize) -> Result<Assignment, AssignError> {
    if shards == 0 {
        return Err(AssignError::NoShards);
    }
    let mut order: Vec<usize> = (0..tokens.len()).collect();
    // Stable: equal lengths keep input order.
    order.sort_by_key(|&i| Reverse(tokens[i]));
    // Min-heap on (tokens, shard).
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (0..shards).map(|s| Reverse((0u64, s))).collect();
    let mut out = vec![Vec::new(); shards];
    let mut load = vec![0u64; shards];
    for i in order {
        let Reverse((t, s)) = heap.pop().expect("the heap holds one entry per shard");
        out[s].push(i);
        load[s] = t + tokens[i] as u64;
        heap.push(Reverse((load[s], s)));
    }
    for s in &mut out {
        s.sort_unstable();
    }
    Ok(Assignment { imbalance: imbalance(&load), shards: out, tokens: load })
}

/// max / mean of per-shard token counts (1.0 if they are all zero).
pub fn imbalance(load: &[u64]) -> f64 {
    let total: u64 = load.iter().sum();
    if total == 0 || load.is_empty() {
        return 1.0;
    }
    let mean = total as f64 / load.len() as f64;
    *load.iter().max().expect("non-empty") as f64 / mean
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn zero_shards_is_an_error_naming_the_setting() {
        let e = assign(&[1, 2], 0).unwrap_err();
        assert!(e.to_string().contains("parallelism.data"));
    }

    #[test]
    fn balances_tokens_not_counts() {
        // One long sample and four short ones: counts would give 3/2, tokens give 8 vs 4.
        let a = assign(&[8, 1, 1, 1, 1], 2).unwrap();
        assert_eq!(a.shards, vec![vec![0], vec![1, 2, 3, 4]]);
        assert_eq!(a.tokens, vec![8, 4]);
        assert!((a.imbalance - 8.0 / 6.0).abs() < 1e-9);
    }

    proptest! {
        #[test]
        fn every_sample_lands_on_exactly_one_shard(
            tokens in prop::collection::vec(0u32..10_000, 0..300),
            shards in 1usize..17,
        ) {
            let a = assign(&tokens, shards).unwrap();
            prop_assert_eq!(a.shards.len(), shards);
            let mut seen: Vec<usize> = a.shards.iter().flatten().copied().collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..tokens.len()).collect::<Vec<_>>());
            for (s, idx) in a.shards.iter().enumerate() {
                prop_assert_eq!(a.tokens[s], idx.iter().map(|&i| tokens[i] as u64).sum::<u64>());
            }
        }

        #[test]
        fn greedy_bound_holds(
            tokens in prop::collection::vec(1u32..10_000, 1..300),
            shards in 1usize..17,
        ) {
            // LPT guarantee: the fullest shard exceeds the mean by at most the longest sample,
            // and is within 4/3 of the optimum (which is at least max(mean, longest)).
            let a = assign(&tokens, shards).unwrap();
            let total: u64 = tokens.iter().map(|&t| t as u64).sum();
            let longest = *tokens.iter().max().unwrap() as u64;
            let max = *a.tokens.iter().max().unwrap();
            let mean = total as f64 / shards as f64;
            prop_assert!(max as f64 <= mean + longest as f64 + 1e-9);
            let lower_bound = mean.max(longest as f64);
            prop_assert!(max as f64 <= lower_bound * 4.0 / 3.0 + longest as f64 / 3.0 + 1e-9);
            prop_assert!(a.imbalance >= 1.0 - 1e-12);
            prop_assert!((a.imbalance - max as f64 / mean).abs() < 1e-9);
        }

        #[test]
        fn loads_depend_only_on_the_multiset_of_lengths(
            tokens in prop::collection::vec(0u32..1000, 0..200),
            shards in 1usize..9,
            seed in any::<u64>(),
        ) {
            let mut shuffled = tokens.clone();
            // Deterministic Fisher-Yates from the seed.
            let mut x = seed | 1;
            for i in (1..shuffled.len()).rev() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                shuffled.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut a = assign(&tokens, shards).unwrap().tokens;
            let mut b = assign(&shuffled, shards).unwrap().tokens;
            a.sort_unstable();
            b.sort_unstable();
            prop_assert_eq!(a, b);
        }

        #[test]
        fn equal_lengths_split_evenly(n in 0usize..500, len in 1u32..5000, shards in 1usize..17) {
            let a = assign(&vec![len; n], shards).unwrap();
            let counts: Vec<usize> = a.shards.iter().map(|s| s.len()).collect();
            prop_assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1);
        }

        #[test]
        fn enough_shards_give_every_long_sample_its_own(
            tokens in prop::collection::vec(1u32..10_000, 1..16),
        ) {
            let a = assign(&tokens, tokens.len()).unwrap();
            prop_assert!(a.shards.iter().all(|s| s.len() == 1));
        }

        #[test]
        fn deterministic(tokens in prop::collection::vec(0u32..100, 0..100), shards in 1usize..9) {
            prop_assert_eq!(assign(&tokens, shards).unwrap(), assign(&tokens, shards).unwrap());
        }
    }
}
