//! What the two `cuda` conformance binaries share: the skip reason (no driver) and the checks the
//! generic suite cannot make because they need device memory of the reader's own (reads into
//! `Dest::Device`, host transfers larger than the pinned staging).

use std::sync::Arc;
use std::time::Duration;

use odc_transport::conformance::{ship, Pair, OWNER};
use odc_transport::cuda::{check_driver, Device, STAGING_BYTES};
use odc_transport::{codec, deadline_in, Dest, DeviceDest, Dtype, TransportError, WriteTag};

/// Why the suite cannot run here (no CUDA driver), or `None`.
pub fn no_cuda() -> Option<String> {
    check_driver().err().map(|e| e.to_string())
}

/// Whether a device test cannot run here; if so, it says why.
pub fn skipped() -> bool {
    let reason = no_cuda();
    if let Some(reason) = &reason {
        eprintln!("skipped: {reason}");
    }
    reason.is_some()
}

fn soon() -> odc_transport::Deadline {
    deadline_in(Duration::from_secs(30))
}

/// `n` distinct values exactly representable in `dtype`.
fn ramp(dtype: Dtype, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| codec::round_trip(dtype, (i % 4096) as f32 * 0.25 + 1.0))
        .collect()
}

/// C1 into device memory: a whole region and a sub-range land in the reader's device buffers
/// bit for bit, with the version; after a publication the next read sees it; a device
/// destination of the wrong size is `BadDestination`, one on another device `Unsupported`, and
/// neither writes anything.
pub async fn device_destination_reads_c1(pair: &Pair, device: &Arc<Device>) {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let n = 1000;
        let size = dtype.size();
        let values = ramp(dtype, n);
        let region = pair
            .owner
            .register_published(OWNER, dtype, codec::encode(dtype, &values), 7)
            .expect("register");
        let handle = ship(&region.handle());
        let whole = device.alloc(n * size).expect("alloc");
        let version = pair
            .reader
            .read(&handle, 0..n, Dest::Device(whole.dest()), soon())
            .await
            .expect("device read");
        assert_eq!(version, 7, "{dtype:?}: version of a device read");
        let got = device.download(&whole).expect("download");
        assert_eq!(got.len(), n * size);
        assert_eq!(
            &got[..],
            &codec::encode(dtype, &values)[..],
            "{dtype:?}: whole read"
        );

        let part = device.alloc(100 * size).expect("alloc");
        pair.reader
            .read(&handle, 250..350, Dest::Device(part.dest()), soon())
            .await
            .expect("device read of a range");
        assert_eq!(
            &device.download(&part).expect("download")[..],
            &codec::encode(dtype, &values[250..350])[..],
            "{dtype:?}: range read lands at the start of the destination"
        );

        let next: Vec<f32> = values.iter().map(|v| -v).collect();
        region
            .publish(8, codec::encode(dtype, &next))
            .expect("publish");
        let version = pair
            .reader
            .read(&handle, 0..n, Dest::Device(whole.dest()), soon())
            .await
            .expect("device read after publish");
        assert_eq!(version, 8);
        assert_eq!(
            &device.download(&whole).expect("download")[..],
            &codec::encode(dtype, &next)[..],
            "{dtype:?}: the new publication"
        );

        let sentinel = vec![0xa5u8; 100 * size];
        device.upload(&part, 0, &sentinel).expect("upload");
        let short = DeviceDest {
            bytes: (99 * size) as u64,
            ..part.dest()
        };
        match pair
            .reader
            .read(&handle, 250..350, Dest::Device(short), soon())
            .await
        {
            Err(TransportError::BadDestination { expected, got, .. }) => {
                assert_eq!((expected, got), ((100 * size) as u64, (99 * size) as u64))
            }
            other => panic!("{dtype:?}: a short device destination gave {other:?}"),
        }
        let elsewhere = DeviceDest {
            device: device.ordinal() + 1,
            ..part.dest()
        };
        match pair
            .reader
            .read(&handle, 250..350, Dest::Device(elsewhere), soon())
            .await
        {
            Err(TransportError::Unsupported { what }) => assert!(what.contains("device"), "{what}"),
            other => panic!("{dtype:?}: a destination on another device gave {other:?}"),
        }
        assert_eq!(
            device.download(&part).expect("download"),
            sentinel,
            "{dtype:?}: refused reads wrote nothing"
        );
    }
}

/// C1, C2 across the pinned staging: a read into host memory and an accumulate larger than the
/// staging buffer (so both move in several pieces) are exact.
pub async fn transfers_larger_than_the_staging_c2(pair: &Pair) {
    let n = STAGING_BYTES / 4 + 1025;
    let values = ramp(Dtype::F32, n);
    let region = pair
        .owner
        .register_published(OWNER, Dtype::F32, codec::encode_f32(&values), 3)
        .expect("register");
    let handle = ship(&region.handle());
    let mut out = vec![f32::NAN; n];
    let version = pair
        .reader
        .read(&handle, 0..n, Dest::F32(&mut out), soon())
        .await
        .expect("large read");
    assert_eq!(version, 3);
    assert_eq!(out.len(), values.len());
    assert!(
        out.iter()
            .zip(&values)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "a read over several staging pieces differs"
    );

    let acc = pair
        .owner
        .register_accumulator(OWNER, n, 0)
        .expect("register accumulator");
    let acc_handle = ship(&acc.handle());
    for write_id in [1, 2] {
        pair.reader
            .accumulate(
                &acc_handle,
                0,
                codec::encode_f32(&values),
                WriteTag {
                    epoch: 0,
                    write_id,
                    token: 0,
                },
                soon(),
            )
            .await
            .expect("large accumulate");
    }
    let sums = acc.take(1);
    assert_eq!(sums.len(), n);
    assert!(
        sums.iter()
            .zip(&values)
            .all(|(s, v)| s.to_bits() == (v + v).to_bits()),
        "an accumulate over several staging pieces differs"
    );
}

/// A push from the reader's device memory into the owner's accumulator
/// (`CudaTransport::accumulate_device`: over CUDA IPC when the owner is another process, from the
/// process's own table when it is another transport of this one) adds exactly what a host
/// accumulate adds (C2), under the same fences (a repeated write id, a stale epoch: C3); a source
/// that is not whole fp32s or runs past its allocation, or a range past the accumulator's end, is
/// refused and adds nothing. Twice, so the second push reuses the first one's staging buffer.
pub async fn device_pushes_c2_c3(pair: &Pair, reader: &odc_transport::cuda::CudaTransport) {
    let device = reader.device();
    let n = 5000;
    let values = ramp(Dtype::F32, n);
    let acc = pair
        .owner
        .register_accumulator(OWNER, n, 0)
        .expect("register accumulator");
    let handle = ship(&acc.handle());
    let src = device.alloc(n * 4).expect("alloc");
    device
        .upload(&src, 0, &codec::encode_f32(&values))
        .expect("upload");
    let tag = |epoch, write_id| WriteTag {
        epoch,
        write_id,
        token: 0,
    };
    for write_id in [1, 2] {
        reader
            .accumulate_device(&handle, 0, src.dest(), tag(0, write_id), soon())
            .await
            .expect("a device push");
    }
    match reader
        .accumulate_device(&handle, 0, src.dest(), tag(0, 1), soon())
        .await
    {
        Err(TransportError::DuplicateWrite { .. }) => {}
        other => panic!("a repeated write id gave {other:?}"),
    }
    let ragged = DeviceDest {
        bytes: 6,
        ..src.dest()
    };
    let past = DeviceDest {
        bytes: src.dest().bytes + 4,
        ..src.dest()
    };
    for (what, dest, offset) in [
        ("half an fp32", ragged, 0),
        ("a source past its allocation", past, 0),
        ("a range past the accumulator", src.dest(), 1),
    ] {
        assert!(
            reader
                .accumulate_device(&handle, offset, dest, tag(0, 9), soon())
                .await
                .is_err(),
            "{what} was accepted"
        );
    }
    let sums = acc.take(1);
    assert!(
        sums.iter()
            .zip(&values)
            .all(|(s, v)| s.to_bits() == (v + v).to_bits()),
        "two device pushes do not add up to twice the values"
    );
    match reader
        .accumulate_device(&handle, 0, src.dest(), tag(0, 3), soon())
        .await
    {
        Err(TransportError::StaleEpoch { .. }) => {}
        other => panic!("a push of the old epoch gave {other:?}"),
    }
}

/// C7 for messages whose values are device memory (`CudaTransport::send_device`,
/// `recv_device`): from another transport (staged, through the owner's socket) and from the
/// owner itself (copied directly), the header arrives as sent and the values as the sender's
/// ranges, in order, bit for bit; a repeated write id and a stale epoch are refused as for any
/// message; a message sent from host memory comes with no values; a range that is not memory of
/// the sender's device is refused. (Receiving needs the owner's transport: in this process only,
/// so `cuda_process_conformance` does not use it.)
#[allow(dead_code)]
pub async fn device_messages_c7(
    owner: &odc_transport::cuda::CudaTransport,
    reader: &odc_transport::cuda::CudaTransport,
) {
    use bytes::Bytes;
    use odc_transport::Transport;
    let inbox = owner.register_inbox(OWNER, 0).expect("register inbox");
    let handle = ship(&inbox.handle());
    let n = 3000;
    let values = ramp(Dtype::F32, n);
    let tag = |epoch, write_id| WriteTag {
        epoch,
        write_id,
        token: 0,
    };
    for (write_id, sender) in [(1u128, reader), (2, owner)] {
        let device = sender.device();
        let src = device.alloc(n * 4).expect("alloc");
        device
            .upload(&src, 0, &codec::encode_f32(&values))
            .expect("upload");
        let whole = src.dest();
        // The second half first, then the first: the values arrive in the order given.
        let half = (n / 2 * 4) as u64;
        let parts = [
            DeviceDest {
                ptr: whole.ptr + half,
                bytes: whole.bytes - half,
                ..whole
            },
            DeviceDest {
                bytes: half,
                ..whole
            },
        ];
        sender
            .send_device(
                &handle,
                tag(0, write_id),
                Bytes::from_static(b"kv"),
                &parts,
                soon(),
            )
            .await
            .expect("a device message");
        let (header, got) = owner
            .recv_device(inbox.as_ref(), tag(0, write_id), soon())
            .await
            .expect("received");
        assert_eq!(&header[..], b"kv");
        let got = got.expect("the message's values");
        let into = owner.device().alloc(got.len()).expect("alloc");
        let whole = into.dest();
        let split = [
            DeviceDest { bytes: 12, ..whole },
            DeviceDest {
                ptr: whole.ptr + 12,
                bytes: whole.bytes - 12,
                ..whole
            },
        ];
        owner.copy_out(&got, &split, soon()).expect("copied out");
        assert!(
            owner.copy_out(&got, &split[..1], soon()).is_err(),
            "destinations short of the values were taken"
        );
        let back =
            codec::decode_f32(&owner.device().download(&into).expect("download")).expect("fp32");
        let want: Vec<f32> = values[n / 2..]
            .iter()
            .chain(&values[..n / 2])
            .copied()
            .collect();
        assert!(
            back.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && back.len() == n,
            "write id {write_id}: the values differ"
        );
        match sender
            .send_device(&handle, tag(0, write_id), Bytes::new(), &parts, soon())
            .await
        {
            Err(TransportError::DuplicateWrite { .. }) => {}
            other => panic!("a repeated device message gave {other:?}"),
        }
    }
    inbox.advance(1);
    let src = reader.device().alloc(16).expect("alloc");
    match reader
        .send_device(&handle, tag(0, 3), Bytes::new(), &[src.dest()], soon())
        .await
    {
        Err(TransportError::StaleEpoch { .. }) => {}
        other => panic!("a device message of an old epoch gave {other:?}"),
    }
    reader
        .send(&handle, tag(1, 4), Bytes::from_static(b"host"), soon())
        .await
        .expect("a host message");
    let (header, got) = owner
        .recv_device(inbox.as_ref(), tag(1, 4), soon())
        .await
        .expect("received");
    assert_eq!(&header[..], b"host");
    assert!(got.is_none(), "a host message came with device values");
    let bogus = DeviceDest {
        ptr: 0x10,
        bytes: 4,
        ..src.dest()
    };
    assert!(
        reader
            .send_device(&handle, tag(1, 5), Bytes::new(), &[bogus], soon())
            .await
            .is_err(),
        "a range that is not device memory was sent"
    );
}
