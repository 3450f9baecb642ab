//! The schema: created or migrated at start, once for every sidecar
//! starting at the same time (an advisory lock serialises them).

use std::sync::atomic::Ordering::SeqCst;

use super::{Conn, PostgresStore};
use crate::error::Error;

/// The schema this build creates and understands.
const SCHEMA_VERSION: i32 = 1;

/// Identifies dedupd's migration lock among the server's advisory locks.
const MIGRATION_LOCK: i64 = 0x6465_6475_7064; // "dedupd"

impl PostgresStore {
    /// Creates or migrates the schema, once for every sidecar starting at
    /// the same time (an advisory lock serialises them).
    pub async fn prepare(&self) -> Result<(), Error> {
        let client = self.client().await?;
        let schema = &self.inner.schema;
        // Every step within the call's deadline; a connection that outlived
        // it is closed, and with it the session's advisory lock.
        self.bounded(
            &client,
            client.query_one("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]),
        )
        .await?;
        let created = format!(
            "CREATE SCHEMA IF NOT EXISTS {schema};
             CREATE TABLE IF NOT EXISTS {schema}.schema_version (version integer NOT NULL);"
        );
        let migrated = match self.bounded(&client, client.batch_execute(&created)).await {
            Ok(()) => self.migrate(&client).await,
            Err(error) => Err(error),
        };
        let unlocked = self
            .bounded(
                &client,
                client.query_one("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]),
            )
            .await;
        migrated?;
        unlocked?;
        self.inner.ready.store(true, SeqCst);
        Ok(())
    }

    async fn migrate(&self, client: &Conn) -> Result<(), Error> {
        let schema = &self.inner.schema;
        let asked = format!("SELECT max(version) FROM {schema}.schema_version");
        let version: Option<i32> = self
            .bounded(client, client.query_opt(&asked, &[]))
            .await?
            .and_then(|row| row.get(0));
        match version {
            Some(SCHEMA_VERSION) => Ok(()),
            Some(newer) if newer > SCHEMA_VERSION => Err(Error::Store(format!(
                "schema {schema} is at version {newer}, newer than this dedupd understands ({SCHEMA_VERSION}): upgrade dedupd"
            ))),
            _ => {
                let created = format!(
                    "CREATE TABLE IF NOT EXISTS {schema}.processed_events (
                        namespace text NOT NULL,
                        correlation_id text NOT NULL,
                        event_type text NOT NULL,
                        consumer_version text NOT NULL,
                        committed_at_ms bigint,
                        processed_at timestamptz GENERATED ALWAYS AS (to_timestamp(committed_at_ms / 1000.0)) STORED,
                        state smallint NOT NULL,
                        lease_token uuid NOT NULL,
                        fencing_token bigint NOT NULL,
                        lease_expires_at_ms bigint NOT NULL,
                        attempt integer NOT NULL,
                        owner text NOT NULL,
                        payload_fingerprint text NOT NULL,
                        claimed_at_ms bigint NOT NULL,
                        retain_until_ms bigint NOT NULL,
                        retention_ms bigint NOT NULL,
                        response bytea NOT NULL,
                        ordering_key text,
                        sequence bigint,
                        request_id text NOT NULL,
                        recovered boolean NOT NULL,
                        revision bigint NOT NULL,
                        PRIMARY KEY (namespace, correlation_id)
                    );
                    CREATE INDEX IF NOT EXISTS processed_events_retain_until
                        ON {schema}.processed_events (retain_until_ms);
                    CREATE TABLE IF NOT EXISTS {schema}.ordering_marks (
                        namespace text NOT NULL,
                        ordering_key text NOT NULL,
                        highest bigint NOT NULL,
                        retain_until_ms bigint NOT NULL,
                        PRIMARY KEY (namespace, ordering_key)
                    );
                    CREATE SEQUENCE IF NOT EXISTS {schema}.fencing_tokens;
                    CREATE SEQUENCE IF NOT EXISTS {schema}.revisions;
                    INSERT INTO {schema}.schema_version (version) VALUES ({SCHEMA_VERSION});"
                );
                self.bounded(client, client.batch_execute(&created)).await
            }
        }
    }
}
