//! Checks a request body before the codec decodes it (placeholder: filled
//! in by the next step).

use kafka_protocol::messages::ApiKey;

/// Checks `body` of `api` at `version`.
///
/// # Errors
/// Why the body cannot be a well-formed request.
pub fn check(_api: ApiKey, _version: i16, _body: &[u8]) -> Result<(), String> {
    Ok(())
}
