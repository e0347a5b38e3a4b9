//! Parsing a GGUF file held in memory.

use std::collections::BTreeMap;
use std::fmt;

use super::TensorType;

const MAGIC: &[u8; 4] = b"GGUF";
const VERSION: u32 = 3;
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
const DIMS_MAX: u32 = 4;
/// Arrays may hold arrays, but not deeper than this.
const NESTING_MAX: u32 = 2;

#[derive(Clone, Debug, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetadataValue {
    /// The value as an unsigned integer, if it is one of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(u64::from(v)),
            MetadataValue::U16(v) => Some(u64::from(v)),
            MetadataValue::U32(v) => Some(u64::from(v)),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetadataValue::F32(v) => Some(v),
            MetadataValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(values) => Some(values),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` varies fastest (a row), so a `[n_embd, n_vocab]`
    /// matrix has `n_vocab` rows of `n_embd`.
    pub dims: Vec<u64>,
    pub kind: TensorType,
    /// From the start of the data section; a multiple of the alignment.
    pub offset: u64,
    pub bytes: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// What was wrong with a GGUF file. The loader adds the file's path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GgufError {
    BadMagic([u8; 4]),
    UnsupportedVersion(u32),
    /// The file ends inside `what`.
    Truncated {
        what: String,
    },
    /// A count larger than the file could hold.
    TooMany {
        what: String,
        count: u64,
    },
    UnknownValueType {
        key: String,
        code: u32,
    },
    NotUtf8 {
        what: String,
    },
    /// The tensor's type is not one lockstep reads.
    UnknownTensorType {
        tensor: String,
        code: u32,
    },
    /// The tensor's shape, offset or size does not fit the file.
    BadTensor {
        tensor: String,
        what: String,
    },
    /// A metadata value of the wrong type or range.
    BadMetadata {
        key: String,
        what: String,
    },
}

impl fmt::Display for GgufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgufError::BadMagic(m) => {
                write!(f, "not a GGUF file (starts with {m:02x?}, not \"GGUF\")")
            }
            GgufError::UnsupportedVersion(v) => {
                write!(f, "GGUF version {v} is not supported (only {VERSION})")
            }
            GgufError::Truncated { what } => write!(f, "file ends inside {what}"),
            GgufError::TooMany { what, count } => {
                write!(f, "{count} {what}: more than the file can hold")
            }
            GgufError::UnknownValueType { key, code } => {
                write!(f, "metadata {key:?} has unknown value type {code}")
            }
            GgufError::NotUtf8 { what } => write!(f, "{what} is not UTF-8"),
            GgufError::UnknownTensorType { tensor, code } => {
                write!(f, "tensor {tensor:?} has type {code}, which lockstep does not read")
            }
            GgufError::BadTensor { tensor, what } => write!(f, "tensor {tensor:?}: {what}"),
            GgufError::BadMetadata { key, what } => write!(f, "metadata {key:?}: {what}"),
        }
    }
}

impl std::error::Error for GgufError {}

/// A parsed GGUF file: its metadata and where each tensor's bytes are.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub metadata: BTreeMap<String, MetadataValue>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_offset: u64,
}

impl Gguf {
    pub fn parse(file: &[u8]) -> Result<Gguf, GgufError> {
        let mut r = Cursor { bytes: file, pos: 0 };
        let magic: [u8; 4] = r.array("magic")?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        if version != VERSION {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = r.u64("tensor count")?;
        let metadata_count = r.u64("metadata count")?;
        // Each key-value pair takes at least 12 bytes, each tensor info at least 28.
        r.check_count("metadata entries", metadata_count, 12)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..metadata_count {
            let key = r.string("metadata key")?;
            let code = r.u32("metadata value type")?;
            let value = r.value(&key, code, 0)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => match value.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    let what = format!("{value:?} is not a power of two");
                    return Err(GgufError::BadMetadata { key: "general.alignment".into(), what });
                }
            },
        };
        r.check_count("tensors", tensor_count, 28)?;
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            tensors.push(r.tensor_info(alignment)?);
        }
        let data_offset = (r.pos as u64).next_multiple_of(alignment);
        check_tensors(&tensors, data_offset, file.len() as u64)?;
        Ok(Gguf { metadata, tensors, alignment, data_offset })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor of this file (checked to lie inside it when parsed).
    pub fn tensor_data<'a>(&self, file: &'a [u8], info: &TensorInfo) -> &'a [u8] {
        let start = (self.data_offset + info.offset) as usize;
        &file[start..start + info.bytes as usize]
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(MetadataValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(MetadataValue::as_u64)
    }

    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(MetadataValue::as_f32)
    }
}

/// Every tensor lies inside the file, and no two share a name.
fn check_tensors(tensors: &[TensorInfo], data_offset: u64, file_len: u64) -> Result<(), GgufError> {
    let mut names = std::collections::BTreeSet::new();
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(GgufError::BadTensor {
                tensor: t.name.clone(),
                what: "name appears twice".into(),
            });
        }
        let end = data_offset.checked_add(t.offset).and_then(|start| start.checked_add(t.bytes));
        if end.is_none_or(|end| end > file_len) {
            let what = format!(
                "{} bytes at data offset {} run past the end of the file ({file_len} bytes)",
                t.bytes, t.offset
            );
            return Err(GgufError::BadTensor { tensor: t.name.clone(), what });
        }
    }
    Ok(())
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let rest = &self.bytes[self.pos..];
        if n > rest.len() as u64 {
            return Err(GgufError::Truncated { what: what.to_owned() });
        }
        self.pos += n as usize;
        Ok(&rest[..n as usize])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, what)?;
        Ok(bytes.try_into().expect("took N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Refuses a count of items of at least `min_bytes` each that the rest of the file could not
    /// hold: what keeps a hostile count from becoming a huge allocation.
    fn check_count(&self, what: &str, count: u64, min_bytes: u64) -> Result<(), GgufError> {
        let left = (self.bytes.len() - self.pos) as u64;
        if count > left / min_bytes.max(1) {
            return Err(GgufError::TooMany { what: what.to_owned(), count });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::NotUtf8 { what: what.to_owned() })
    }

    fn value(&mut self, key: &str, code: u32, depth: u32) -> Result<MetadataValue, GgufError> {
        Ok(match code {
            0 => MetadataValue::U8(self.array::<1>(key)?[0]),
            1 => MetadataValue::I8(self.array::<1>(key)?[0] as i8),
            2 => MetadataValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetadataValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetadataValue::U32(self.u32(key)?),
            5 => MetadataValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetadataValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => MetadataValue::Bool(false),
                1 => MetadataValue::Bool(true),
                other => {
                    return Err(GgufError::BadMetadata {
                        key: key.to_owned(),
                        what: format!("bool byte {other}"),
                    });
                }
            },
            8 => MetadataValue::String(self.string(key)?),
            9 if depth < NESTING_MAX => {
                let element = self.u32(key)?;
                let count = self.u64(key)?;
                let min_bytes = match element {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                };
                self.check_count(key, count, min_bytes)?;
                let mut values = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    values.push(self.value(key, element, depth + 1)?);
                }
                MetadataValue::Array(values)
            }
            9 => {
                return Err(GgufError::BadMetadata {
                    key: key.to_owned(),
                    what: "arrays nested too deep".into(),
                });
            }
            10 => MetadataValue::U64(self.u64(key)?),
            11 => MetadataValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetadataValue::F64(f64::from_le_bytes(self.array(key)?)),
            code => return Err(GgufError::UnknownValueType { key: key.to_owned(), code }),
        })
    }

    fn tensor_info(&mut self, alignment: u64) -> Result<TensorInfo, GgufError> {
        let name = self.string("tensor name")?;
        let bad = |what: String| GgufError::BadTensor { tensor: name.clone(), what };
        let n_dims = self.u32(&name)?;
        if n_dims == 0 || n_dims > DIMS_MAX {
            return Err(bad(format!("{n_dims} dimensions (1 to {DIMS_MAX} allowed)")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&name)?);
        }
        let code = self.u32(&name)?;
        let kind = TensorType::from_code(code)
            .ok_or_else(|| GgufError::UnknownTensorType { tensor: name.clone(), code })?;
        let offset = self.u64(&name)?;
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&e| e > 0);
        let Some(elements) = elements else {
            return Err(bad(format!("shape {dims:?} is empty or overflows")));
        };
        if !dims[0].is_multiple_of(kind.block_elements()) {
            return Err(bad(format!(
                "rows of {} are not whole {:?} blocks of {}",
                dims[0],
                kind,
                kind.block_elements()
            )));
        }
        let bytes =
            kind.bytes_for(elements).ok_or_else(|| bad(format!("{elements} elements overflow")))?;
        if !offset.is_multiple_of(alignment) {
            return Err(bad(format!(
                "offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        Ok(TensorInfo { name, dims, kind, offset, bytes })
    }
}
