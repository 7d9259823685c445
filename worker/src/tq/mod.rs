//! The transfer queue: metadata-only controller, storage units, clients and the wire codec.
