{{- define "dedupd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dedupd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dedupd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "dedupd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "dedupd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dedupd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* DEDUPD_* variables for every non-empty config value. */}}
{{- define "dedupd.env" -}}
{{- $names := dict
  "sync" "DEDUPD_SYNC" "cacheMb" "DEDUPD_CACHE_MB" "memoryBudget" "DEDUPD_MEMORY_BUDGET"
  "defaultLeaseTtl" "DEDUPD_DEFAULT_LEASE_TTL" "maxLeaseTtl" "DEDUPD_MAX_LEASE_TTL"
  "defaultRetention" "DEDUPD_DEFAULT_RETENTION" "maxRetention" "DEDUPD_MAX_RETENTION"
  "namespaceRetention" "DEDUPD_NAMESPACE_RETENTION" "maxResponseBytes" "DEDUPD_MAX_RESPONSE_BYTES"
  "maxBatchSize" "DEDUPD_MAX_BATCH_SIZE" "maxMessageBytes" "DEDUPD_MAX_MESSAGE_BYTES"
  "reaperInterval" "DEDUPD_REAPER_INTERVAL" "shutdownGrace" "DEDUPD_SHUTDOWN_GRACE"
  "requestTimeout" "DEDUPD_REQUEST_TIMEOUT" "maxConcurrentRequests" "DEDUPD_MAX_CONCURRENT_REQUESTS"
  "logFormat" "DEDUPD_LOG_FORMAT" "log" "DEDUPD_LOG" "workerThreads" "DEDUPD_WORKER_THREADS"
  "requestReadTimeout" "DEDUPD_REQUEST_READ_TIMEOUT" "maxConnections" "DEDUPD_MAX_CONNECTIONS"
  "maxStreamsPerConnection" "DEDUPD_MAX_STREAMS_PER_CONNECTION" "maxConnectionAge" "DEDUPD_MAX_CONNECTION_AGE"
  "diskReserveMb" "DEDUPD_DISK_RESERVE_MB" "storeStallTimeout" "DEDUPD_STORE_STALL_TIMEOUT"
  "storePoolSize" "DEDUPD_STORE_POOL_SIZE" "storeTimeout" "DEDUPD_STORE_TIMEOUT"
  "localTierMb" "DEDUPD_LOCAL_TIER_MB" "localTierMaxAge" "DEDUPD_LOCAL_TIER_MAX_AGE"
  "maxClockUncertainty" "DEDUPD_MAX_CLOCK_UNCERTAINTY" "storeReplicas" "DEDUPD_STORE_REPLICAS"
  "allowRedisEviction" "DEDUPD_ALLOW_REDIS_EVICTION" "storeCluster" "DEDUPD_STORE_CLUSTER" }}
{{- range $key, $value := .Values.config }}
{{- if not (hasKey $names $key) }}
{{- fail (printf "config.%s is not a dedupd setting" $key) }}
{{- end }}
{{- if ne (toString $value) "" }}
- name: {{ get $names $key }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}
{{- end }}
