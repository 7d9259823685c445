//! Measures the transfer queue's wire format against Arrow IPC for the same columns: one step of
//! GRPO rollouts (ragged `input_ids` i64, `logprobs` f32, `loss_mask` u8, scalar `reward` f32).
//!
//! `cargo run --release -p rlplane --example tq_wire_cost -- [SAMPLES] [MIN_TOKENS] [MAX_TOKENS]`
//!
//! Both formats are timed on what a sender does before the socket and what a receiver does after
//! it: building the message, and checking / exposing the columns. "contiguous" variants copy the
//! values once into (or out of) one byte vector, as a plain socket read or write of the whole
//! message would; the zero-copy variants are what each format allows at best (ours: header and
//! offsets only, values go out by vectored writes; Arrow: decoding from a shared buffer).

use std::sync::Arc;
use std::time::Instant;

use arrow_array::{ArrayRef, Float32Array, Int64Array, ListArray, RecordBatch, UInt8Array};
use arrow_buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use arrow_ipc::reader::{StreamDecoder, StreamReader};
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema};
use rlplane::bench::tq::synthetic_rollouts;
use rlplane::tq::codec::{self, Block, Body, Header, WIRE_VERSION};
use rlplane::tq::{Column, Element};

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..reps {
        let t = Instant::now();
        let v = std::hint::black_box(f());
        best = best.min(t.elapsed().as_secs_f64());
        out = Some(v);
    }
    (best, out.expect("reps > 0"))
}

fn typed<T: Element>(c: &Column) -> Vec<T> {
    c.values().chunks_exact(T::DTYPE.size()).map(T::from_le).collect()
}

fn list(c: &Column, item: DataType, values: ArrayRef) -> ArrayRef {
    let offsets: Vec<i32> = c.offsets().iter().map(|&o| o as i32).collect();
    Arc::new(ListArray::new(
        Arc::new(Field::new("item", item, false)),
        OffsetBuffer::new(ScalarBuffer::from(offsets)),
        values,
        None,
    ))
}

fn main() {
    let args: Vec<u32> = std::env::args().skip(1).map(|a| a.parse().expect("numeric arguments")).collect();
    let samples = args.first().copied().unwrap_or(1024);
    let (lo, hi) = (args.get(1).copied().unwrap_or(256), args.get(2).copied().unwrap_or(4096));
    let (keys, cols) = synthetic_rollouts(0, samples, (lo, hi), 256, 1);
    let value_bytes: usize = cols.iter().map(|c| c.nbytes()).sum();

    // Ours.
    let header = Header { version: WIRE_VERSION, request_id: 1, token: "e0-0123456789abcdef".into() };
    let block = Block { n: samples, columns: cols.iter().map(|c| (c.spec().clone(), c.nbytes() as u64)).collect() };
    let body = Body::Put { partition: "step-0".into(), keys: keys.clone(), block };
    let reps = 20;
    let (ours_enc_zc, _) = time(reps, || {
        let frame = codec::encode(&header, &body);
        let offs: Vec<Vec<u8>> = cols.iter().map(|c| codec::encode_offsets(c.offsets())).collect();
        (frame, offs)
    });
    let (ours_enc, msg) = time(reps, || {
        let offs: Vec<Vec<u8>> = cols.iter().map(|c| codec::encode_offsets(c.offsets())).collect();
        let mut bufs: Vec<&[u8]> = Vec::new();
        for (c, o) in cols.iter().zip(&offs) {
            if c.spec().ragged {
                bufs.push(o);
            }
            bufs.push(c.values());
        }
        codec::encode_message_bytes(&header, &body, &bufs)
    });
    let (ours_dec, _) = time(reps, || codec::decode_message_bytes(&msg).expect("decodes"));
    let (ours_dec_zc, _) = time(reps, || {
        // Header, then offsets checked in place; values stay where they are.
        let len = u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize;
        let (_, body) = codec::decode(&msg[4..4 + len]).unwrap();
        let block = body.block().unwrap().clone();
        let mut at = 4 + len;
        for (spec, values) in &block.columns {
            if spec.ragged {
                let n = u64::from_le_bytes(msg[at..at + 8].try_into().unwrap()) as usize;
                let off = &msg[at + 8..at + 8 + n];
                codec::decode_offsets(&spec.name, off, block.n, *values, spec.row_bytes().unwrap()).unwrap();
                at += 8 + n;
            }
            let n = u64::from_le_bytes(msg[at..at + 8].try_into().unwrap()) as usize;
            std::hint::black_box(&msg[at + 8..at + 8 + n]);
            at += 8 + n;
        }
        at
    });

    // Arrow IPC (stream format), same columns; List<…> with i32 offsets.
    let schema = Arc::new(Schema::new(vec![
        Field::new("key", DataType::Utf8, false),
        Field::new("input_ids", DataType::List(Arc::new(Field::new("item", DataType::Int64, false))), false),
        Field::new("logprobs", DataType::List(Arc::new(Field::new("item", DataType::Float32, false))), false),
        Field::new("loss_mask", DataType::List(Arc::new(Field::new("item", DataType::UInt8, false))), false),
        Field::new("reward", DataType::Float32, false),
    ]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(arrow_array::StringArray::from(keys.clone())),
            list(&cols[0], DataType::Int64, Arc::new(Int64Array::from(typed::<i64>(&cols[0])))),
            list(&cols[1], DataType::Float32, Arc::new(Float32Array::from(typed::<f32>(&cols[1])))),
            list(&cols[2], DataType::UInt8, Arc::new(UInt8Array::from(typed::<u8>(&cols[2])))),
            Arc::new(Float32Array::from(typed::<f32>(&cols[3]))),
        ],
    )
    .expect("a valid batch");
    let (arrow_enc, ipc) = time(reps, || {
        let mut out = Vec::with_capacity(value_bytes + (1 << 20));
        let mut w = StreamWriter::try_new(&mut out, &schema).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        drop(w);
        out
    });
    let (arrow_dec, _) = time(reps, || {
        let mut r = StreamReader::try_new(std::io::Cursor::new(&ipc), None).unwrap();
        r.next().unwrap().unwrap()
    });
    let shared = Buffer::from(ipc.clone());
    let (arrow_dec_zc, _) = time(reps, || {
        let mut d = StreamDecoder::new();
        let mut b = shared.clone();
        let mut got = None;
        while !b.is_empty() {
            if let Some(batch) = d.decode(&mut b).unwrap() {
                got = Some(batch);
            }
        }
        got.unwrap()
    });

    let gbps = |s: f64| value_bytes as f64 / s / 1e9;
    println!(
        "{samples} samples, responses {lo}..{hi} tokens (+256 prompt): {:.1} MB of values",
        value_bytes as f64 / 1e6
    );
    println!("{:<44} {:>10} {:>10}", "", "ms", "GB/s");
    for (name, s) in [
        ("ours: encode, zero-copy (header + offsets)", ours_enc_zc),
        ("ours: encode into one buffer (copy)", ours_enc),
        ("arrow ipc: encode (StreamWriter, copy)", arrow_enc),
        ("ours: decode, zero-copy (header + offsets)", ours_dec_zc),
        ("ours: decode from one buffer (copy)", ours_dec),
        ("arrow ipc: decode (StreamReader, copy)", arrow_dec),
        ("arrow ipc: decode, zero-copy (StreamDecoder)", arrow_dec_zc),
    ] {
        println!("{name:<44} {:>10.3} {:>10.2}", s * 1e3, gbps(s));
    }
    println!(
        "wire bytes: ours {} , arrow ipc {} ({:+.2}%)",
        msg.len(),
        ipc.len(),
        (ipc.len() as f64 / msg.len() as f64 - 1.0) * 100.0
    );
}
