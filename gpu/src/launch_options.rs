//! How the CUDA backend launches a forward pass (`cuda::launch`), and its spelling on the command
//! line (`--cuda-launch`). Outside feature `cuda` so that every build parses the flag the same
//! way and a bad value is an error before anything loads.

use std::fmt;

/// How a forward pass is launched, and how the weights it reads are stored; none changes a bit of
/// what it computes (the device check runs a request alone and in a batch with all of them on and
/// off and compares the bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchOptions {
    /// Every kernel after the first as a programmatic dependent launch (sm_90 on).
    pub dependent_launches: bool,
    /// The layers' RMSNorms folded into the products after them on steps of at most
    /// `cuda::executor::FOLDED_NORM_TOKENS_MAX` tokens.
    pub fold_norms: bool,
    /// Products of steps of `cuda::executor::WIDE_PRODUCT_TOKENS_MIN` tokens or more with 4
    /// output rows a warp (2 for SwiGLU, whose warp reads a gate and an up row for each), so
    /// that every activation load serves that many rows: at 32 tokens and more the products
    /// reload activations far more than they read weights.
    pub wide_products: bool,
    /// RoPE and the KV write folded into attention on steps of one token a row (every decode
    /// step): a launch a layer fewer, each attention block rotating its own heads.
    pub fold_rope: bool,
    /// Matrices of GGUF's block types (`Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`, `Q5_K`,
    /// `Q6_K`) kept in their blocks on the device and dequantized in the kernels that read them, instead of
    /// dequantized to f32 at load: 5 to 10 bits a weight read instead of 32. Switching it
    /// uploads the weights again.
    pub block_weights: bool,
    /// On steps of up to `cuda::launch::SPLIT_ATTENTION_TOKENS_MAX` tokens, each token's
    /// attention in blocks of 512 positions (its splits) side by side, then a merge: a long
    /// context at a small batch otherwise walks its positions in one block per head.
    pub split_attention: bool,
}

/// Each option's name on the command line, in `LaunchOptions`' order.
const NAMES: [&str; 6] = [
    "dependent-launches",
    "fold-norms",
    "wide-products",
    "fold-rope",
    "block-weights",
    "split-attention",
];

impl LaunchOptions {
    pub const ALL: LaunchOptions = LaunchOptions {
        dependent_launches: true,
        fold_norms: true,
        wide_products: true,
        fold_rope: true,
        block_weights: true,
        split_attention: true,
    };

    /// `none`, `all`, or a comma-separated list of `dependent-launches`, `fold-norms`,
    /// `wide-products`, `fold-rope`, `block-weights` and `split-attention`.
    pub fn parse(text: &str) -> Result<LaunchOptions, String> {
        match text {
            "none" => return Ok(LaunchOptions::default()),
            "all" => return Ok(LaunchOptions::ALL),
            _ => {}
        }
        let mut options = LaunchOptions::default();
        for name in text.split(',') {
            let flag = match name.trim() {
                "dependent-launches" => &mut options.dependent_launches,
                "fold-norms" => &mut options.fold_norms,
                "wide-products" => &mut options.wide_products,
                "fold-rope" => &mut options.fold_rope,
                "block-weights" => &mut options.block_weights,
                "split-attention" => &mut options.split_attention,
                other => {
                    return Err(format!(
                        "--cuda-launch: {other:?} is not none, all or a list of {}",
                        NAMES.join(", ")
                    ));
                }
            };
            *flag = true;
        }
        Ok(options)
    }

    fn flags(self) -> [bool; 6] {
        [
            self.dependent_launches,
            self.fold_norms,
            self.wide_products,
            self.fold_rope,
            self.block_weights,
            self.split_attention,
        ]
    }
}

/// The spelling `parse` reads back.
impl fmt::Display for LaunchOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let on: Vec<&str> =
            NAMES.iter().zip(self.flags()).filter(|(_, on)| *on).map(|(name, _)| *name).collect();
        if on.is_empty() { f.write_str("none") } else { f.write_str(&on.join(",")) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_reads_back_and_a_bad_one_is_named() {
        assert_eq!(LaunchOptions::parse("none"), Ok(LaunchOptions::default()));
        assert_eq!(LaunchOptions::parse("all"), Ok(LaunchOptions::ALL));
        let two = LaunchOptions::parse("wide-products, dependent-launches").unwrap();
        assert_eq!(
            two,
            LaunchOptions {
                dependent_launches: true,
                wide_products: true,
                ..LaunchOptions::default()
            }
        );
        for bits in 0..64u8 {
            let options = LaunchOptions {
                dependent_launches: bits & 1 != 0,
                fold_norms: bits & 2 != 0,
                wide_products: bits & 4 != 0,
                fold_rope: bits & 8 != 0,
                block_weights: bits & 16 != 0,
                split_attention: bits & 32 != 0,
            };
            assert_eq!(LaunchOptions::parse(&options.to_string()), Ok(options), "{options}");
        }
        let err = LaunchOptions::parse("dependent-launches,fast").unwrap_err();
        assert!(err.contains("\"fast\"") && err.contains("block-weights"), "{err}");
        assert!(LaunchOptions::parse("").is_err());
    }
}
