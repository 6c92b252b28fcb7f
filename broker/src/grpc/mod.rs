//! The client API (`ferrolog.client.v1.Ferrolog`): thin handlers that decode
//! a request, call the partition or controller, and encode the answer.
//!
//! - [`errors`]: the one place API errors become wire errors.
//! - [`service`]: the handlers.

pub mod errors;
pub mod service;

pub use service::ClientService;
