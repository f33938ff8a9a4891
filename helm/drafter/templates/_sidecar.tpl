{{/*
Sidecar mode: templates for putting the drafter into an engine's own pod.

From a parent chart that lists this chart as a dependency (name: drafter) and sets `drafter.mode: sidecar` and
`drafter.sidecar.example.enabled: false` in its values, call them with this chart's values as .Values (and the
cluster's .Capabilities, so that sidecar.native=true fails clearly on Kubernetes older than 1.29):

  {{- $drafter := dict "Values" .Values.drafter "Capabilities" .Capabilities }}
  spec:
    terminationGracePeriodSeconds: {{ include "drafter.terminationGracePeriodSeconds" $drafter }}
    securityContext:
      fsGroup: 10001                     # = drafter securityContext.runAsGroup, so the engine may use the socket
    initContainers:
      {{- include "drafter.sidecar.initContainers" $drafter | nindent 6 }}
    containers:
      - name: engine
        env:
          - name: DRAFTER_ADDRESS
            value: {{ include "drafter.sidecar.address" $drafter | quote }}
        volumeMounts:
          {{- include "drafter.sidecar.engineVolumeMounts" $drafter | nindent 10 }}
      {{- include "drafter.sidecar.containers" $drafter | nindent 6 }}
    volumes:
      {{- include "drafter.sidecar.volumes" $drafter | nindent 6 }}

helm/examples/engine-with-drafter is such a parent chart; templates/engine-example.yaml uses the same calls.
Each renders a YAML list (maybe empty); volume names all start with "drafter-".
*/}}

{{- define "drafter.sidecar.assertMode" -}}
{{- if ne .Values.mode "sidecar" -}}
{{- fail "the drafter.sidecar.* templates need the drafter chart's values to say mode: sidecar" -}}
{{- end -}}
{{- end }}

{{/*
A native sidecar (an init container with restartPolicy: Always) needs Kubernetes 1.29 or later; on an older cluster
the API server would drop restartPolicy and the pod would wait forever for the drafter "init container" to exit.
Checked where the caller's context carries .Capabilities (this chart; a parent chart that adds
"Capabilities" .Capabilities to the dict; without it the parent's own kubeVersion is the guard).
*/}}
{{- define "drafter.sidecar.assertNativeSupported" -}}
{{- with .Capabilities -}}
{{- if semverCompare "<1.29.0-0" .KubeVersion.Version -}}
{{- fail (printf "sidecar.native=true needs Kubernetes 1.29 or later (native sidecar containers), but the cluster is %s: set sidecar.native=false to run the drafter as a plain second container of the pod (docs/deployment.md)" .KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/* initContainers entries: model copies, extraInitContainers, then the drafter itself when sidecar.native */}}
{{- define "drafter.sidecar.initContainers" -}}
{{- include "drafter.sidecar._initContainers" . | trim }}
{{- end }}

{{- define "drafter.sidecar._initContainers" -}}
{{- include "drafter.sidecar.assertMode" . -}}
{{- include "drafter.initContainers" . }}
{{- if .Values.sidecar.native }}
{{- include "drafter.sidecar.assertNativeSupported" . }}
{{ include "drafter.container" . }}
{{- end }}
{{- end }}

{{/* containers entries: the drafter when not sidecar.native, else nothing */}}
{{- define "drafter.sidecar.containers" -}}
{{- include "drafter.sidecar._containers" . | trim }}
{{- end }}

{{- define "drafter.sidecar._containers" -}}
{{- include "drafter.sidecar.assertMode" . -}}
{{- if not .Values.sidecar.native }}
{{ include "drafter.container" . }}
{{- end }}
{{- end }}

{{/* volumes entries: socket emptyDir, /tmp emptyDir, model volumes, extraVolumes */}}
{{- define "drafter.sidecar.volumes" -}}
{{- include "drafter.sidecar._volumes" . | trim }}
{{- end }}

{{- define "drafter.sidecar._volumes" -}}
{{- include "drafter.sidecar.assertMode" . -}}
{{ include "drafter.volumes" . }}
{{- end }}

{{/* volumeMounts entries for each engine container that talks to the drafter */}}
{{- define "drafter.sidecar.engineVolumeMounts" -}}
- name: drafter-socket
  mountPath: {{ .Values.sidecar.socketDir }}
{{- if .Values.sharedMemory.enabled }}
- name: drafter-shm
  mountPath: /dev/shm
{{- end }}
{{- end }}
