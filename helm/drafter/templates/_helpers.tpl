{{/*
Names and labels. These take the chart's root context (pool objects, the example engine Deployment).
*/}}
{{- define "drafter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "drafter.fullname" -}}
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

{{- define "drafter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "drafter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "drafter.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "drafter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Findings of checkov (https://www.checkov.io) on the pool Deployment that the chart accepts on purpose, as checkov's
skip annotations ("<check id>=<reason>", no "=" in the reason). Each one goes away when the values fix its finding.
*/}}
{{- define "drafter.checkovSkips" -}}
{{- $v := .Values -}}
{{- if ne $v.image.pullPolicy "Always" }}
checkov.io/skip1: {{ "CKV_K8S_15=IfNotPresent - a release tag or image.digest names one image, and pulling a multi-GB CUDA image on every start only slows restarts" | quote }}
{{- end }}
{{- if not $v.image.digest }}
checkov.io/skip2: {{ "CKV_K8S_43=no image is published to pin by default; set image.digest to pin yours" | quote }}
{{- end }}
{{- if not (dig "limits" "cpu" "" ($v.resources | default dict)) }}
checkov.io/skip3: {{ "CKV_K8S_11=no CPU limit by default - CFS throttling would stall the step thread on the critical path of every engine step; set resources.limits.cpu to add one" | quote }}
{{- end }}
{{- if not $v.networkPolicy.enabled }}
checkov.io/skip4: {{ "CKV2_K8S_6=the NetworkPolicy is optional (networkPolicy.enabled) because its peers depend on the cluster" | quote }}
{{- end }}
{{- end }}

{{/*
Everything below takes a context whose .Values are this chart's values (the root context, or
(dict "Values" .Values.drafter "Capabilities" .Capabilities) from a parent chart), and uses nothing else from it
but .Capabilities, where it is there (drafter.sidecar.assertNativeSupported).
*/}}

{{/* image reference of the drafter */}}
{{- define "drafter.image" -}}
{{- $i := .Values.image -}}
{{- $repo := required "image.repository is required: build docker/Dockerfile, push it, and set image.repository (and image.tag)" $i.repository -}}
{{- if $i.digest -}}
{{- printf "%s@%s" $repo $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (required "image.tag (or image.digest) is required" ($i.tag | toString)) -}}
{{- end -}}
{{- end }}

{{/* "- FLAG\n- VALUE" when .v is not null; .int formats the value as an integer (YAML numbers arrive as floats) */}}
{{- define "drafter.optFlag" -}}
{{- if not (kindIs "invalid" .v) }}
- {{ .flag }}
- {{ ternary (.v | int64 | toString) (.v | toString) (.int | default false) | quote }}
{{- end }}
{{- end }}

{{/* directory passed as --model / --target-model. Args: m (model values), what (values key, for errors) */}}
{{- define "drafter.modelDir" -}}
{{- $m := .m -}}
{{- if eq $m.source "image" -}}
{{- required (printf "%s.imagePath is required with %s.source=image" .what .what) $m.imagePath -}}
{{- else -}}
{{- $sub := trimAll "/" ($m.subdir | default "") -}}
{{- if $sub -}}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) $sub -}}
{{- else -}}
{{- $m.mountPath -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* TCP listen address */}}
{{- define "drafter.tcpListen" -}}
{{- $s := .Values.server -}}
{{- if contains ":" $s.bindAddress -}}
{{- printf "[%s]:%d" $s.bindAddress ($s.port | int) -}}
{{- else -}}
{{- printf "%s:%d" $s.bindAddress ($s.port | int) -}}
{{- end -}}
{{- end }}

{{/* whether the drafter listens on TCP: "true" or "" */}}
{{- define "drafter.hasTcp" -}}
{{- if or (ne .Values.mode "sidecar") (eq .Values.sidecar.probeTransport "grpc") -}}true{{- end -}}
{{- end }}

{{/* the Unix socket address engines in the pod connect to (sidecar mode) */}}
{{- define "drafter.sidecar.address" -}}
{{- printf "unix:%s/%s" (trimSuffix "/" .Values.sidecar.socketDir) .Values.sidecar.socketName -}}
{{- end }}

{{/* drafter-serve arguments, a YAML list */}}
{{- define "drafter.args" -}}
{{- $v := .Values -}}
{{- $s := $v.server -}}
{{- if and (not (kindIs "invalid" $s.kvCacheTokens)) (not (kindIs "invalid" $s.gpuMemoryFraction)) -}}
{{- fail "server.kvCacheTokens and server.gpuMemoryFraction are mutually exclusive: set at most one" -}}
{{- end -}}
- --model
- {{ include "drafter.modelDir" (dict "m" $v.model "what" "model") | quote }}
{{- if ne $v.targetModel.source "none" }}
- --target-model
- {{ include "drafter.modelDir" (dict "m" $v.targetModel "what" "targetModel") | quote }}
{{- end }}
{{- if eq $v.mode "sidecar" }}
- --listen
- {{ include "drafter.sidecar.address" . | quote }}
{{- end }}
{{- if include "drafter.hasTcp" . }}
- --listen
- {{ include "drafter.tcpListen" . | quote }}
{{- end }}
{{- include "drafter.optFlag" (dict "flag" "--device" "v" $s.device) }}
{{- include "drafter.optFlag" (dict "flag" "--dtype" "v" $s.dtype) }}
{{- include "drafter.optFlag" (dict "flag" "--kv-cache-tokens" "v" $s.kvCacheTokens "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--gpu-memory-fraction" "v" $s.gpuMemoryFraction) }}
{{- include "drafter.optFlag" (dict "flag" "--block-size" "v" $s.blockSize "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--max-model-len" "v" $s.maxModelLen "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--max-draft-tokens" "v" $s.maxDraftTokens "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--max-batch-tokens" "v" $s.maxBatchTokens "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--max-message-bytes" "v" $s.maxMessageBytes "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--sequence-lease-s" "v" $s.sequenceLeaseSeconds) }}
{{- include "drafter.optFlag" (dict "flag" "--max-sequences" "v" $s.maxSequences "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--max-sequences-per-namespace" "v" $s.maxSequencesPerNamespace "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--namespace-pool-share" "v" $s.namespacePoolShare) }}
{{- include "drafter.optFlag" (dict "flag" "--merge-window-us" "v" $s.mergeWindowMicroseconds "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--metrics-port" "v" $s.metricsPort "int" true) }}
{{- include "drafter.optFlag" (dict "flag" "--log-level" "v" $s.logLevel) }}
{{- include "drafter.optFlag" (dict "flag" "--log-format" "v" $s.logFormat) }}
{{- include "drafter.optFlag" (dict "flag" "--otel-endpoint" "v" $s.otelEndpoint) }}
{{- include "drafter.optFlag" (dict "flag" "--shutdown-grace-s" "v" $s.shutdownGraceSeconds "int" true) }}
{{- if $s.engineAppliesFc }}
- --engine-applies-fc
{{- end }}
{{- range $s.extraArgs }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}

{{/*
Probe handler check used with sidecar.probeTransport=exec: argv = address, health service name, timeout seconds.
Exit 0 only for SERVING.
*/}}
{{- define "drafter.healthCheckScript" -}}
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=sys.argv[2]), timeout=float(sys.argv[3]))
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
{{- end }}

{{/* startupProbe / readinessProbe / livenessProbe of the drafter container */}}
{{- define "drafter.probes" -}}
{{- $ctx := . -}}
{{- $v := .Values -}}
{{- $exec := and (eq $v.mode "sidecar") (eq $v.sidecar.probeTransport "exec") -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $p := index $v.probes $kind }}
{{- if $p.enabled }}
{{- $service := ternary "" "drafter.v1.Drafter" (eq $kind "liveness") }}
{{ $kind }}Probe:
  {{- if $exec }}
  exec:
    command:
      - python3
      - -c
      - {{ include "drafter.healthCheckScript" $ctx | quote }}
      - {{ include "drafter.sidecar.address" $ctx | quote }}
      - {{ $service | quote }}
      - {{ $p.timeoutSeconds | int | toString | quote }}
  {{- else }}
  grpc:
    port: {{ $v.server.port | int }}
    service: {{ $service | quote }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds | int }}
  timeoutSeconds: {{ $p.timeoutSeconds | int }}
  failureThreshold: {{ $p.failureThreshold | int }}
{{- end }}
{{- end }}
{{- end }}

{{/* seconds of the drafter's preStop sleep: pool: preStopSleepSeconds; non-native sidecar: engineGraceSeconds */}}
{{- define "drafter.preStopSeconds" -}}
{{- $v := .Values -}}
{{- if ne $v.mode "sidecar" -}}
{{- $v.preStopSleepSeconds | int -}}
{{- else if not $v.sidecar.native -}}
{{- $v.sidecar.engineGraceSeconds | int -}}
{{- else -}}
0
{{- end -}}
{{- end }}

{{/* terminationGracePeriodSeconds for the pod the drafter runs in */}}
{{- define "drafter.terminationGracePeriodSeconds" -}}
{{- $v := .Values -}}
{{- $before := ternary ($v.sidecar.engineGraceSeconds | int) ($v.preStopSleepSeconds | int) (eq $v.mode "sidecar") -}}
{{- $min := add ($v.server.shutdownGraceSeconds | int) $before -}}
{{- if kindIs "invalid" $v.terminationGracePeriodSeconds -}}
{{- add $min 15 -}}
{{- else if le ($v.terminationGracePeriodSeconds | int) $min -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be larger than server.shutdownGraceSeconds plus the preStop/engine drain time (%d)" ($v.terminationGracePeriodSeconds | int) $min) -}}
{{- else -}}
{{- $v.terminationGracePeriodSeconds | int -}}
{{- end -}}
{{- end }}

{{/* volume of one model source. Args: m, name, what */}}
{{- define "drafter.modelVolume" -}}
{{- $m := .m -}}
{{- if eq $m.source "pvc" }}
- name: {{ .name }}
  persistentVolumeClaim:
    claimName: {{ required (printf "%s.pvc.claimName is required with %s.source=pvc" .what .what) $m.pvc.claimName | quote }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: {{ .name }}
  hostPath:
    path: {{ required (printf "%s.hostPath.path is required with %s.source=hostPath" .what .what) $m.hostPath.path | quote }}
    {{- with $m.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else if or (eq $m.source "copy") (eq $m.source "emptyDir") }}
{{- $ed := dict }}
{{- with $m.emptyDir.medium }}{{ $_ := set $ed "medium" . }}{{ end }}
{{- with $m.emptyDir.sizeLimit }}{{ $_ := set $ed "sizeLimit" . }}{{ end }}
- name: {{ .name }}
  emptyDir: {{ toYaml $ed | nindent 4 }}
{{- end }}
{{- end }}

{{/* volumeMount of one model source in the drafter container. Args: m, name */}}
{{- define "drafter.modelVolumeMount" -}}
{{- if not (has .m.source (list "image" "none")) }}
- name: {{ .name }}
  mountPath: {{ .m.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* init container copying a model into its emptyDir (source=copy). Args: m, name, what, ctx */}}
{{- define "drafter.modelCopyInitContainer" -}}
{{- $m := .m -}}
{{- if eq $m.source "copy" }}
{{- $v := .ctx.Values }}
{{- $src := required (printf "%s.copy.sourcePath is required with %s.source=copy" .what .what) $m.copy.sourcePath }}
- name: {{ printf "copy-%s" .name }}
  {{- if $m.copy.image.repository }}
  image: {{ printf "%s:%s" $m.copy.image.repository (required (printf "%s.copy.image.tag is required" .what) ($m.copy.image.tag | toString)) | quote }}
  imagePullPolicy: {{ $m.copy.image.pullPolicy }}
  {{- else }}
  image: {{ include "drafter.image" .ctx | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- end }}
  command: ["cp", "-R", {{ printf "%s/." (trimSuffix "/" $src) | quote }}, {{ printf "%s/" (trimSuffix "/" $m.mountPath) | quote }}]
  {{- with $m.copy.resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext: {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: {{ .name }}
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end }}

{{/* the drafter container (a one-item YAML list) */}}
{{- define "drafter.container" -}}
{{- $v := .Values -}}
{{- $sidecar := eq $v.mode "sidecar" -}}
{{- $preStop := include "drafter.preStopSeconds" . | int -}}
- name: drafter
  image: {{ include "drafter.image" . | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if and $sidecar $v.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  {{- if and $sidecar $v.sidecar.socketUmask }}
  command: ["/bin/sh", "-c", {{ printf "umask %s && exec drafter-serve \"$@\"" $v.sidecar.socketUmask | quote }}, "drafter-serve"]
  {{- end }}
  args:
    {{- include "drafter.args" . | nindent 4 }}
  {{- with $v.extraEnv }}
  env: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or (include "drafter.hasTcp" .) (gt ($v.server.metricsPort | int) 0) }}
  ports:
    {{- if include "drafter.hasTcp" . }}
    - name: {{ ternary "drafter-grpc" "grpc" $sidecar }}
      containerPort: {{ $v.server.port | int }}
      protocol: TCP
    {{- end }}
    {{- if gt ($v.server.metricsPort | int) 0 }}
    - name: {{ ternary "drafter-metrics" "metrics" $sidecar }}
      containerPort: {{ $v.server.metricsPort | int }}
      protocol: TCP
    {{- end }}
  {{- end }}
  {{- with (include "drafter.probes" . | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- if gt $preStop 0 }}
  lifecycle:
    preStop:
      {{- if $v.preStopNativeSleep }}
      sleep:
        seconds: {{ $preStop }}
      {{- else }}
      exec:
        command: ["sleep", {{ $preStop | toString | quote }}]
      {{- end }}
  {{- end }}
  {{- with $v.resources }}
  resources: {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext: {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: drafter-tmp
      mountPath: /tmp
    {{- if $v.sharedMemory.enabled }}
    - name: drafter-shm
      mountPath: /dev/shm
    {{- end }}
    {{- if $sidecar }}
    - name: drafter-socket
      mountPath: {{ $v.sidecar.socketDir }}
    {{- end }}
    {{- with (include "drafter.modelVolumeMount" (dict "m" $v.model "name" "drafter-model") | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with (include "drafter.modelVolumeMount" (dict "m" $v.targetModel "name" "drafter-target-model") | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* init containers that prepare the drafter's volumes: model copies, then extraInitContainers (a YAML list, maybe empty) */}}
{{- define "drafter.initContainers" -}}
{{- $v := .Values -}}
{{- include "drafter.modelCopyInitContainer" (dict "m" $v.model "name" "drafter-model" "what" "model" "ctx" .) }}
{{- include "drafter.modelCopyInitContainer" (dict "m" $v.targetModel "name" "drafter-target-model" "what" "targetModel" "ctx" .) }}
{{- with $v.extraInitContainers }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* the drafter's volumes (a YAML list) */}}
{{- define "drafter.volumes" -}}
{{- $v := .Values -}}
- name: drafter-tmp
  emptyDir:
    {{- with $v.tmpVolume.sizeLimit }}
    sizeLimit: {{ . }}
    {{- else }} {}
    {{- end }}
{{- if eq $v.mode "sidecar" }}
- name: drafter-socket
  emptyDir: {}
{{- end }}
{{- if $v.sharedMemory.enabled }}
- name: drafter-shm
  emptyDir:
    medium: Memory
    {{- with $v.sharedMemory.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- include "drafter.modelVolume" (dict "m" $v.model "name" "drafter-model" "what" "model") }}
{{- include "drafter.modelVolume" (dict "m" $v.targetModel "name" "drafter-target-model" "what" "targetModel") }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}
