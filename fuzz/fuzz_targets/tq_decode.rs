//! Fuzzes the transfer queue's decoders: a header frame alone, a whole message with its buffer
//! frames, and a ragged column's offsets. None may panic; whatever decodes must re-encode to a
//! message that decodes to the same thing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rlplane_tq::codec::{decode, decode_message_bytes, decode_offsets, encode_message_bytes};

fuzz_target!(|data: &[u8]| {
    let _ = decode(data);
    if let Ok((m, used)) = decode_message_bytes(data) {
        assert!(used <= data.len());
        let bufs: Vec<&[u8]> = m.buffers.iter().map(|b| b.as_slice()).collect();
        let again = encode_message_bytes(&m.header, &m.body, &bufs);
        assert_eq!(decode_message_bytes(&again).expect("re-encoded message decodes").0, m);
    }
    if data.len() >= 9 {
        let n = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) % 64;
        let row = (data[4] as u64 % 16) + 1;
        let _ = decode_offsets("fuzz", &data[5..], n, data.len() as u64, row);
    }
});
