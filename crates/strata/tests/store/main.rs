//! The chunk store: property tests of the codecs and of the store against a model, and the crash
//! harness that cuts power at every sync point of a workload.
//!
//! One test binary for the area (fewer binaries to link); each module holds one subject.

mod crash;
mod prop;
