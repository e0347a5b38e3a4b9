//! GGUF parsing against files written here (every field and every failure), and against the
//! bundled default model when it has been fetched (`ci/fetch-default-model.sh`; CI requires it).

use super::*;

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv_str("general.architecture", "llama")
        .kv_u32("llama.context_length", 2048)
        .kv_f32("llama.rope.freq_base", 10000.0)
        .kv_bool("tokenizer.ggml.add_bos_token", true)
        .kv_strings("tokenizer.ggml.tokens", &["<s>", "hello", "world"])
        .tensor("a.weight", &[4, 2], TensorType::F32, &[7; 32])
        .tensor("b.weight", &[32, 2], TensorType::Q4_1, &[9; 40]);
    w
}

#[test]
fn a_written_file_parses_back() {
    let file = sample().bytes();
    let gguf = Gguf::parse(&file).unwrap();
    assert_eq!(gguf.get_str("general.architecture"), Some("llama"));
    assert_eq!(gguf.get_u64("llama.context_length"), Some(2048));
    assert_eq!(gguf.get_f32("llama.rope.freq_base"), Some(10000.0));
    assert_eq!(gguf.get("tokenizer.ggml.add_bos_token"), Some(&MetadataValue::Bool(true)));
    let tokens = gguf.get("tokenizer.ggml.tokens").and_then(MetadataValue::as_array).unwrap();
    assert_eq!(
        tokens.iter().filter_map(MetadataValue::as_str).collect::<Vec<_>>(),
        ["<s>", "hello", "world"]
    );
    assert_eq!(gguf.tensors.len(), 2);
    let b = gguf.tensor("b.weight").unwrap();
    assert_eq!(
        (b.dims.as_slice(), b.kind, b.offset, b.bytes),
        (&[32, 2][..], TensorType::Q4_1, 32, 40)
    );
    assert_eq!(gguf.tensor_data(&file, b), &[9; 40][..]);
    assert_eq!(gguf.tensor_data(&file, gguf.tensor("a.weight").unwrap()), &[7; 32][..]);
    assert_eq!(gguf.data_offset % 32, 0);
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let file = sample().bytes();
    for cut in 0..file.len() {
        assert!(Gguf::parse(&file[..cut]).is_err(), "a file cut at {cut} of {} parsed", file.len());
    }
}

#[test]
fn bad_files_name_what_is_wrong() {
    let mut file = sample().bytes();
    file[0] = b'X';
    assert!(matches!(Gguf::parse(&file), Err(GgufError::BadMagic(_))));

    let mut file = sample().bytes();
    file[4] = 2;
    assert_eq!(Gguf::parse(&file).unwrap_err(), GgufError::UnsupportedVersion(2));

    let mut w = GgufWriter::new();
    w.tensor("odd", &[32], TensorType::Q4_1, &[0; 20]);
    let mut file = w.bytes();
    let code_at = file.windows(4).rposition(|b| b == 3u32.to_le_bytes()).unwrap();
    file[code_at..code_at + 4].copy_from_slice(&99u32.to_le_bytes());
    let err = Gguf::parse(&file).unwrap_err();
    assert_eq!(err, GgufError::UnknownTensorType { tensor: "odd".into(), code: 99 });
    assert!(err.to_string().contains("\"odd\""), "the message names the tensor: {err}");

    // A tensor whose bytes run past the end of the file.
    let mut w = GgufWriter::new();
    w.tensor("short", &[8], TensorType::F32, &[0; 32]);
    let mut file = w.bytes();
    file.truncate(file.len() - 4);
    assert!(
        matches!(Gguf::parse(&file), Err(GgufError::BadTensor { ref tensor, .. }) if tensor == "short")
    );

    // Rows that are not whole blocks.
    let mut w = GgufWriter::new();
    w.tensor("ragged", &[16, 2], TensorType::Q4_1, &[0; 20]);
    assert!(matches!(Gguf::parse(&w.bytes()), Err(GgufError::BadTensor { .. })));

    // Two tensors with one name.
    let mut w = GgufWriter::new();
    w.tensor("twice", &[8], TensorType::F32, &[0; 32]).tensor(
        "twice",
        &[8],
        TensorType::F32,
        &[0; 32],
    );
    assert!(
        matches!(Gguf::parse(&w.bytes()), Err(GgufError::BadTensor { what, .. }) if what.contains("twice"))
    );

    // An alignment that is not a power of two.
    let mut w = GgufWriter::new();
    w.kv("general.alignment", 4, &24u32.to_le_bytes());
    assert!(matches!(Gguf::parse(&w.bytes()), Err(GgufError::BadMetadata { .. })));
}

#[test]
fn huge_counts_are_refused_before_allocating() {
    // A header claiming 2^60 tensors and 2^60 metadata entries in a 24-byte file.
    let mut file = b"GGUF".to_vec();
    file.extend_from_slice(&3u32.to_le_bytes());
    file.extend_from_slice(&(1u64 << 60).to_le_bytes());
    file.extend_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(matches!(Gguf::parse(&file), Err(GgufError::TooMany { .. })));
    // An array claiming 2^40 strings.
    let mut w = GgufWriter::new();
    let mut v = 8u32.to_le_bytes().to_vec();
    v.extend_from_slice(&(1u64 << 40).to_le_bytes());
    w.kv("tokenizer.ggml.tokens", 9, &v);
    assert!(matches!(Gguf::parse(&w.bytes()), Err(GgufError::TooMany { .. })));
}

#[test]
fn arbitrary_bytes_never_panic() {
    let mut state = 0x1234_5678_9abc_def0u64;
    let base = sample().bytes();
    for _ in 0..2_000 {
        let mut file = base.clone();
        for _ in 0..4 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let at = (state >> 33) as usize % file.len();
            file[at] = (state >> 13) as u8;
        }
        let _ = Gguf::parse(&file);
    }
}

/// The bundled default model, when fetched. CI fetches it and sets LOCKSTEP_REQUIRE_MODEL, so
/// there this test cannot pass by skipping.
#[test]
fn the_default_model_parses() {
    let path = std::env::var_os("LOCKSTEP_DEFAULT_MODEL")
        .map_or_else(crate::default_model::path, std::path::PathBuf::from);
    let Ok(file) = std::fs::read(&path) else {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_MODEL").is_none(),
            "the default model is required but missing at {}",
            path.display()
        );
        eprintln!(
            "skipped: no default model at {} (run ci/fetch-default-model.sh)",
            path.display()
        );
        return;
    };
    let gguf = Gguf::parse(&file).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(gguf.get_str("general.architecture"), Some("llama"));
    assert_eq!(gguf.tensors.len(), 272);
    let embed = gguf.tensor("token_embd.weight").unwrap();
    assert_eq!(embed.dims, vec![576, 49152]);
    let vocab = gguf.get("tokenizer.ggml.tokens").and_then(MetadataValue::as_array).unwrap();
    assert_eq!(vocab.len(), 49152);
    assert_eq!(gguf.get_u64("llama.block_count"), Some(30));
    assert!(gguf.get_str("tokenizer.chat_template").is_some_and(|t| t.contains("im_start")));
    let total: u64 = gguf.tensors.iter().map(|t| t.bytes).sum();
    assert!(gguf.data_offset + total <= file.len() as u64);
}
