import { LabIcon } from '@jupyterlab/ui-components';

import llamaSvg from '../style/icons/llama.svg';

export const llamaIcon = new LabIcon({
  name: 'jupyter-llama:llama',
  svgstr: llamaSvg
});
