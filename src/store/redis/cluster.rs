//! One primary (at a fixed address, or named by sentinels) or a Redis
//! Cluster: the [`Connection`] every call goes through (a cluster's routes
//! each call by its key, or where a [`RoutingInfo`] says), and what else
//! differs between them ([`Topology`]).

use std::{
    collections::HashMap,
    fmt,
    sync::{atomic::AtomicUsize, Arc},
};

use redis::{
    aio::ConnectionManager,
    cluster_async::ClusterConnection,
    cluster_routing::{Route, RoutingInfo},
};

use super::sentinel::{Sentinel, SentinelConnection};

/// One multiplexed way to Redis: a connection manager to one primary, or
/// a cluster client (its slot map, a connection per node, MOVED and ASK
/// followed, the map refreshed when a node moves or fails). Every call in
/// this module goes through it unchanged: a key's command or script is
/// routed by its key.
#[derive(Clone)]
pub enum Connection {
    /// One primary.
    Primary(ConnectionManager),
    /// The primary the sentinels name.
    Sentinel(SentinelConnection),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(
        &'a mut self,
        command: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Connection::Primary(connection) => connection.req_packed_command(command),
            Connection::Sentinel(connection) => connection.req_packed_command(command),
            Connection::Cluster(connection) => connection.req_packed_command(command),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Connection::Primary(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Sentinel(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Cluster(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Primary(connection) => connection.get_db(),
            Connection::Sentinel(connection) => connection.get_db(),
            Connection::Cluster(connection) => connection.get_db(),
        }
    }
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Connection::Primary(_) => "Connection::Primary",
            Connection::Sentinel(_) => "Connection::Sentinel",
            Connection::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl Connection {
    /// Runs `command` where `routing` says on a cluster (several nodes'
    /// answers come back as a map by node); on one primary, there.
    pub async fn route(
        &mut self,
        command: redis::Cmd,
        routing: RoutingInfo,
    ) -> redis::RedisResult<redis::Value> {
        match self {
            Connection::Primary(connection) => command.query_async(connection).await,
            Connection::Sentinel(connection) => command.query_async(connection).await,
            Connection::Cluster(connection) => connection.route_command(command, routing).await,
        }
    }
}

/// What differs between one primary and a cluster besides the connections.
pub(super) enum Topology {
    /// One primary: the deletion feed subscribes here.
    Primary { client: redis::Client },
    /// One primary named by sentinels: the deletion feed subscribes on the
    /// one they name when it starts.
    Sentinel { sentinel: Arc<Sentinel> },
    /// A cluster.
    Cluster {
        /// The seed nodes, where the deletion feed subscribes (the next one
        /// after a failure: a classic `PUBLISH` reaches every node).
        seeds: Vec<redis::Client>,
        next_seed: AtomicUsize,
        /// A hash tag for every slot (`{<tag>}` hashes to it), so a fence key
        /// lands on the primary of the key it fences.
        fence_tags: HashMap<Route, String>,
    },
}
