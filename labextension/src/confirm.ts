/** Ask before doing something that cannot be undone (releasing a lease, cancelling a booking). */
import { Dialog, showDialog } from '@jupyterlab/apputils';

/**
 * A JupyterLab dialog: what goes and what it means, "Keep it" (the default, and what Escape does)
 * and a warn button named after the action. Resolves true once the action is confirmed.
 */
export async function confirmAction(title: string, body: string, label: string): Promise<boolean> {
  const answer = await showDialog({
    title,
    body,
    buttons: [Dialog.cancelButton({ label: 'Keep it' }), Dialog.warnButton({ label })],
    defaultButton: 0
  });
  return answer.button.accept;
}
