{{/* Names and labels (Helm's conventions: 63 characters, DNS-1123). */}}
{{- define "disagg-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disagg-router.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "disagg-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "disagg-router.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "disagg-router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "disagg-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disagg-router.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "disagg-router.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "disagg-router.redisName" -}}
{{- printf "%s-redis" (include "disagg-router.fullname" . | trunc 57 | trimSuffix "-") -}}
{{- end -}}

{{- define "disagg-router.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace -}}
{{- end -}}

{{/*
The drain: after SIGTERM the router refuses new work and lets running streams finish for
server.shutdown_grace_s, then gives interrupted streams 5 s to end with an error frame
(router/edge/shutdown.py _CUT_WAIT_S), then aiohttp's own clean-up may take up to 10 s more
(router/edge/server.py shutdown_timeout). preStop's sleep comes before all of it.
*/}}
{{- define "disagg-router.shutdownGrace" -}}
{{- $server := .Values.config.server | default dict -}}
{{- if hasKey $server "shutdown_grace_s" -}}
{{- int (ceil (float64 $server.shutdown_grace_s)) -}}
{{- else -}}
20
{{- end -}}
{{- end -}}

{{- define "disagg-router.drainSeconds" -}}
{{- $grace := int (include "disagg-router.shutdownGrace" .) -}}
{{- add (int .Values.terminationGrace.preStopSleepSeconds) $grace 15 -}}
{{- end -}}

{{- define "disagg-router.terminationGracePeriodSeconds" -}}
{{- $drain := int (include "disagg-router.drainSeconds" .) -}}
{{- $given := .Values.terminationGrace.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $given -}}
{{- add $drain (int .Values.terminationGrace.marginSeconds) -}}
{{- else if le (int $given) $drain -}}
{{- fail (printf "terminationGrace.terminationGracePeriodSeconds (%d) must be more than the router's drain: preStopSleepSeconds %d + config.server.shutdown_grace_s %s + 15 s of stream cut-off and clean-up = %d s; Kubernetes would kill streams still draining" (int $given) (int .Values.terminationGrace.preStopSleepSeconds) (include "disagg-router.shutdownGrace" .) $drain) -}}
{{- else -}}
{{- int $given -}}
{{- end -}}
{{- end -}}

{{/*
Checks of values that the schema cannot express (each fails with what to do instead).
*/}}
{{- define "disagg-router.checks" -}}
{{- $cfg := .Values.config -}}
{{- range $old := list "redis_url" "admin_token" "admin_read_token" "api_keys" "host" "port" "shutdown_grace_s" -}}
{{- if hasKey $cfg $old -}}
{{- fail (printf "config.%s: not set in config with this chart (the deprecated flat name, or a setting the chart owns): see values.yaml (redis:, auth:, containerPort, config.server.shutdown_grace_s)" $old) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $cfg "store" -}}
{{- if hasKey $cfg.store "url" -}}
{{- fail "config.store.url: the Redis URL comes from redis: (redis.external.url, urlSecret or passwordSecret), so that no password lands in the ConfigMap" -}}
{{- end -}}
{{- end -}}
{{- if hasKey $cfg "auth" -}}
{{- range $secret := list "admin_token" "admin_read_token" "api_keys" -}}
{{- if hasKey $cfg.auth $secret -}}
{{- fail (printf "config.auth.%s: a secret never goes in the ConfigMap; reference a Secret with auth.adminTokenSecret / adminReadTokenSecret / apiKeysSecret" $secret) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $i, $tenant := ($cfg.tenants | default list) -}}
{{- range $j, $key := ($tenant.keys | default list) -}}
{{- $plain := "" -}}
{{- if kindIs "string" $key -}}{{- $plain = $key -}}{{- else if hasKey $key "key" -}}{{- $plain = "x" -}}{{- end -}}
{{- if and $plain (not (hasPrefix "sha256:" $plain)) -}}
{{- fail (printf "config.tenants[%d].keys[%d]: a plain key would land in the ConfigMap; give its hash, sha256:<hex> (or {hash: sha256:<hex>, id: ...})" $i $j) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.redis.mode "memory" -}}
{{- if or (gt (int .Values.replicaCount) 1) .Values.autoscaling.enabled -}}
{{- fail "redis.mode memory keeps the state inside one process: replicaCount must be 1 and autoscaling disabled (or use redis.mode external)" -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.redis.mode "external" -}}
{{- if and (not .Values.redis.external.url) (not .Values.redis.external.urlSecret) -}}
{{- fail "redis.mode external needs redis.external.url or redis.external.urlSecret" -}}
{{- end -}}
{{- if and .Values.redis.external.passwordSecret (not .Values.redis.external.url) -}}
{{- fail "redis.external.passwordSecret goes with redis.external.url (the password is written into it)" -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.discovery.kind "kubernetes") (not (or .Values.discovery.prefill_selector .Values.discovery.decode_selector .Values.discovery.both_selector)) -}}
{{- fail "discovery.kind kubernetes needs at least one of discovery.prefill_selector, decode_selector, both_selector" -}}
{{- end -}}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" -}}
{{- end -}}
{{- end -}}

{{/*
The router's config file: values' `config` with the discovery section (kubernetes only), its
namespace defaulted to the release's and unset (null) keys left out.
*/}}
{{- define "disagg-router.configFile" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- if eq .Values.discovery.kind "kubernetes" -}}
{{- $d := dict -}}
{{- range $k, $v := .Values.discovery -}}
{{- if not (kindIs "invalid" $v) -}}
{{- $_ := set $d $k $v -}}
{{- end -}}
{{- end -}}
{{- $_ := set $d "namespace" (include "disagg-router.discoveryNamespace" .) -}}
{{- $_ := set $cfg "discovery" $d -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The Redis URL for the environment ("" = none: the in-process store). */}}
{{- define "disagg-router.storeUrl" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s:6379/0" (include "disagg-router.redisName" .) -}}
{{- else if and (eq .Values.redis.mode "external") .Values.redis.external.url -}}
{{- $url := .Values.redis.external.url -}}
{{- if .Values.redis.external.passwordSecret -}}
{{- $parts := splitn "://" 2 $url -}}
{{- printf "%s://%s:$(DISAGG_REDIS_PASSWORD)@%s" $parts._0 .Values.redis.external.username $parts._1 -}}
{{- else -}}
{{- $url -}}
{{- end -}}
{{- end -}}
{{- end -}}
