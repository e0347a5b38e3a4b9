//! The tensor types lockstep reads, with their block layout: how many elements a block holds and
//! how many bytes it takes. Codes are ggml's.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TensorType {
    F32,
    F16,
    BF16,
    /// 32 weights: an f16 scale and 32 4-bit values.
    Q4_0,
    /// 32 weights: f16 scale and minimum, 32 4-bit values.
    Q4_1,
    /// 32 weights: an f16 scale, 32 5-bit values (the fifth bits in a 32-bit word).
    Q5_0,
    /// 32 weights: f16 scale and minimum, 32 5-bit values.
    Q5_1,
    /// 32 weights: an f16 scale and 32 8-bit values.
    Q8_0,
    /// 256 weights in 8 sub-blocks with 6-bit scales and minimums.
    Q4K,
    /// 256 weights in 8 sub-blocks with 6-bit scales and minimums, 5 bits each.
    Q5K,
    /// 256 weights in 16 sub-blocks, 6 bits each.
    Q6K,
}

impl TensorType {
    /// The type with ggml code `code`, if lockstep reads it.
    pub fn from_code(code: u32) -> Option<TensorType> {
        Some(match code {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            6 => TensorType::Q5_0,
            7 => TensorType::Q5_1,
            8 => TensorType::Q8_0,
            12 => TensorType::Q4K,
            13 => TensorType::Q5K,
            14 => TensorType::Q6K,
            30 => TensorType::BF16,
            _ => return None,
        })
    }

    pub fn code(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q4_0 => 2,
            TensorType::Q4_1 => 3,
            TensorType::Q5_0 => 6,
            TensorType::Q5_1 => 7,
            TensorType::Q8_0 => 8,
            TensorType::Q4K => 12,
            TensorType::Q5K => 13,
            TensorType::Q6K => 14,
            TensorType::BF16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_elements(self) -> u64 {
        match self {
            TensorType::F32 | TensorType::F16 | TensorType::BF16 => 1,
            TensorType::Q4_0
            | TensorType::Q4_1
            | TensorType::Q5_0
            | TensorType::Q5_1
            | TensorType::Q8_0 => 32,
            TensorType::Q4K | TensorType::Q5K | TensorType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            TensorType::F32 => 4,
            TensorType::F16 | TensorType::BF16 => 2,
            TensorType::Q4_0 => 2 + 16,
            TensorType::Q4_1 => 2 + 2 + 16,
            TensorType::Q5_0 => 2 + 4 + 16,
            TensorType::Q5_1 => 2 + 2 + 4 + 16,
            TensorType::Q8_0 => 2 + 32,
            TensorType::Q4K => 2 + 2 + 12 + 128,
            TensorType::Q5K => 2 + 2 + 12 + 32 + 128,
            TensorType::Q6K => 128 + 64 + 16 + 2,
        }
    }

    /// Bytes a tensor of `elements` takes, or `None` if `elements` is not a whole number of
    /// blocks (or the size overflows).
    pub fn bytes_for(self, elements: u64) -> Option<u64> {
        if !elements.is_multiple_of(self.block_elements()) {
            return None;
        }
        (elements / self.block_elements()).checked_mul(self.block_bytes())
    }
}
