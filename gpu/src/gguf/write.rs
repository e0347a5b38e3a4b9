//! Writing GGUF v3 files, field by field as the format says (layout in the module's docs). The
//! parser's tests write what they parse with it, and the tests and examples that need a model
//! llama.cpp can also load (tiny K-quant models, `gpu/tests/quantized`) write theirs with it.

use super::TensorType;

/// A GGUF file under construction: metadata and tensors in the order they are added.
#[derive(Debug)]
pub struct GgufWriter {
    metadata: Vec<u8>,
    metadata_count: u64,
    infos: Vec<u8>,
    tensor_count: u64,
    data: Vec<u8>,
    alignment: u64,
}

/// Metadata value type codes (`gguf_type`).
const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;

impl Default for GgufWriter {
    fn default() -> GgufWriter {
        GgufWriter {
            metadata: Vec::new(),
            metadata_count: 0,
            infos: Vec::new(),
            tensor_count: 0,
            data: Vec::new(),
            // The default alignment; a file that sets `general.alignment` must call `align`.
            alignment: 32,
        }
    }
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    /// A key with a value of type `code` already encoded: for values the typed methods do not
    /// cover, and for the parser's tests to write what no well-formed file holds.
    pub fn kv(&mut self, key: &str, code: u32, value: &[u8]) -> &mut GgufWriter {
        Self::string(&mut self.metadata, key);
        self.metadata.extend_from_slice(&code.to_le_bytes());
        self.metadata.extend_from_slice(value);
        self.metadata_count += 1;
        self
    }

    pub fn kv_u32(&mut self, key: &str, value: u32) -> &mut GgufWriter {
        self.kv(key, U32, &value.to_le_bytes())
    }

    pub fn kv_f32(&mut self, key: &str, value: f32) -> &mut GgufWriter {
        self.kv(key, F32, &value.to_le_bytes())
    }

    pub fn kv_bool(&mut self, key: &str, value: bool) -> &mut GgufWriter {
        self.kv(key, BOOL, &[u8::from(value)])
    }

    pub fn kv_str(&mut self, key: &str, value: &str) -> &mut GgufWriter {
        let mut v = Vec::new();
        Self::string(&mut v, value);
        self.kv(key, STRING, &v)
    }

    pub fn kv_strings(&mut self, key: &str, values: &[&str]) -> &mut GgufWriter {
        let mut v = Self::array_head(STRING, values.len());
        for s in values {
            Self::string(&mut v, s);
        }
        self.kv(key, ARRAY, &v)
    }

    pub fn kv_f32s(&mut self, key: &str, values: &[f32]) -> &mut GgufWriter {
        let mut v = Self::array_head(F32, values.len());
        values.iter().for_each(|x| v.extend_from_slice(&x.to_le_bytes()));
        self.kv(key, ARRAY, &v)
    }

    pub fn kv_i32s(&mut self, key: &str, values: &[i32]) -> &mut GgufWriter {
        let mut v = Self::array_head(I32, values.len());
        values.iter().for_each(|x| v.extend_from_slice(&x.to_le_bytes()));
        self.kv(key, ARRAY, &v)
    }

    fn array_head(code: u32, len: usize) -> Vec<u8> {
        let mut v = code.to_le_bytes().to_vec();
        v.extend_from_slice(&(len as u64).to_le_bytes());
        v
    }

    /// A tensor whose bytes are `bytes` (whole blocks of `kind`, not checked here: the parser's
    /// tests write bad ones), placed at the next aligned offset. `dims` innermost first, as
    /// ggml lists them.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        kind: TensorType,
        bytes: &[u8],
    ) -> &mut GgufWriter {
        let offset = (self.data.len() as u64).next_multiple_of(self.alignment);
        self.data.resize(offset as usize, 0);
        self.data.extend_from_slice(bytes);
        Self::string(&mut self.infos, name);
        self.infos.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&kind.code().to_le_bytes());
        self.infos.extend_from_slice(&offset.to_le_bytes());
        self.tensor_count += 1;
        self
    }

    /// The file.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&self.tensor_count.to_le_bytes());
        out.extend_from_slice(&self.metadata_count.to_le_bytes());
        out.extend_from_slice(&self.metadata);
        out.extend_from_slice(&self.infos);
        out.resize((out.len() as u64).next_multiple_of(self.alignment) as usize, 0);
        out.extend_from_slice(&self.data);
        out
    }
}
