{{/* The image, as kustomize's images: stanza names it. */}}
{{- define "cgpud.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
