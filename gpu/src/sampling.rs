//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, drawing from
//! a generator that belongs to one request and is seeded from (run seed, request id), so a
//! request's tokens never depend on what else ran beside it.

/// How to pick tokens. Temperature 0 is greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the smallest set whose probability reaches `top_p`; 1.0 keeps all.
    pub top_p: f32,
}

impl SamplingParams {
    pub const GREEDY: SamplingParams = SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0 };
}

/// One request's sampler and its own random generator (splitmix64: tiny, fast, and the same
/// everywhere).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams, run_seed: u64, request_id: u64) -> Sampler {
        let mut sampler = Sampler {
            params,
            state: run_seed ^ request_id.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15,
        };
        sampler.next_u64();
        sampler
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        // Candidates in order of decreasing logit, ties by lower id: no hidden tie-breaks.
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        if self.params.top_k > 0 {
            order.truncate(self.params.top_k as usize);
        }
        let max = logits[order[0] as usize];
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| f64::from((logits[i as usize] - max) / self.params.temperature).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.top_p < 1.0 {
            let mut mass = 0.0;
            let keep = probs.iter().position(|&p| {
                mass += p;
                mass >= f64::from(self.params.top_p)
            });
            let keep = keep.map_or(probs.len(), |i| i + 1);
            order.truncate(keep);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut draw = self.next_f64() * total;
        for (&id, &p) in order.iter().zip(&probs) {
            if draw < p {
                return id;
            }
            draw -= p;
        }
        *order.last().expect("at least one candidate")
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The index of the largest logit; ties go to the lowest index.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::GREEDY, 1, 1);
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits = [0.5, 2.0, 1.9, -3.0, 1.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 1, top_p: 1.0 }, 7, 3);
        assert!((0..50).all(|_| s.sample(&logits) == 1));
        let draw = |seed, id| {
            let mut s =
                Sampler::new(SamplingParams { temperature: 0.8, top_k: 0, top_p: 0.95 }, seed, id);
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7, 3), draw(7, 3), "same run seed and request, same tokens");
        assert_ne!(draw(7, 3), draw(7, 4), "another request draws on its own");
    }

    #[test]
    fn top_p_cuts_the_tail_and_frequencies_follow_probabilities() {
        // Probabilities about 0.64, 0.24, 0.09, 0.03 at temperature 1.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p: 0.85 }, 1, 1);
        let mut counts = [0u32; 4];
        for _ in 0..20_000 {
            counts[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "beyond top-p: never drawn");
        let share = f64::from(counts[0]) / 20_000.0;
        assert!((share - 0.64 / 0.88).abs() < 0.02, "top token drawn {share}");
    }
}
