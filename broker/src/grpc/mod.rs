//! The client API (`ferrolog.client.v1.Ferrolog`): thin handlers that decode
//! a request, call the partition or controller, and encode the answer.
//!
//! - [`errors`]: the one place API errors become wire errors.
//! - [`service`]: the handlers.
//! - [`fetch_wire`]: `Fetch` answered without copying records, in front of
//!   the generated service.

pub mod errors;
pub mod fetch_wire;
pub mod service;

pub use service::ClientService;
